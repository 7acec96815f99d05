"""Selectors: every read a page makes, and that the REST API reuses, so that a table on a
page and the same table in the export come from one place. Each function makes a bounded
number of queries whatever the number of rows and returns plain dicts and lists.

- shapes.py: a protocol, drafter or run as a dict; aggregation of cells;
- protocols.py: targets, protocols, the protocol page;
- board.py: the leaderboard and the compare page;
- drafters.py: the drafter page and the API's drafter list;
- runs.py: the queue and the API's run list;
- results.py: result rows, pages and the CSV export stream;
- accounts.py: a user's tokens and drafters.
"When does it pay?" reads live in leaderboard/pays.py.
"""
