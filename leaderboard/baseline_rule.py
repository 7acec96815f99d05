"""The baseline rule in words, as the protocol page and the API state it (the rule itself:
leaderboard/services/baselines.py). A module of its own so that selectors read these words
without importing services: services read through selectors, never the reverse."""

PINNED_RULE = (
    "Under a shared baseline a drafter cell divides by the matching cell (same task, batch "
    "size, temperature, engine version and hardware class) of the newest succeeded baseline "
    "run of this protocol version at the time the cell is divided. The baseline cell is "
    "stored with the figure and every page, the API and the export follow it: re-measuring "
    "the baseline does not change stored speedups. `python manage.py repin_speedups` "
    "re-divides chosen runs by the baseline the rule picks now, and says which figures "
    "changed.")
PAIRED_RULE = (
    "Under a paired baseline every drafter run measures the baseline cells itself, on the "
    "same worker, pass by pass beside its own cells (the baseline's pass r, then each k's "
    "pass r); each speedup divides by the k = 0 cell of the same run.")
