"""The lab (`toolkv bench --lab`): toolkv's own acceptance runs, on top of the bench a user runs.

command (the lab's `Suite` for the bench's command.run) -> scenarios (the lab's registry added to
the bench's): history (history, history_report), constrained (constrained, validity,
constrained_report; rows from the bench's bfcl), fleet (fleet, fleet_metrics, fleet_report,
baselines) and hostile-soak (hostile); floor and floor_report (the model in the bench's own
process: what a hit cannot go below); targets (every target in one table, and the checks).
"""
