"""Services: everything that writes. Pages, commands, the API and the Celery task call these;
reads go through leaderboard/selectors/ and leaderboard/pays.py.

- runs.py: queue, claim, measure (the orchestration the Celery task calls), record cells,
  finish, cancel;
- setup.py: targets, protocols, prompt import, the demo set-up;
- submissions.py: drafter submission, edits, withdrawal.
"""
