"""The scenarios' names, in the order they run: the command line lists them (options) without
importing the scenarios (the bench extra), and the registries (scenarios, lab/scenarios) are
checked against them."""

SCENARIO_NAMES = ("single", "toolcount", "interleaved", "restart", "concurrent", "compile-overlap", "soak", "agent",
                  "peer")
LAB_SCENARIO_NAMES = ("history", "constrained", "fleet", "hostile-soak")  # `toolkv bench --lab` only
ONLY_WHEN_NAMED = ("peer", *LAB_SCENARIO_NAMES)  # peer: also with --peer-url
# `--quick` without --scenario: what a new user needs first (a miss, hits on the same tools, groups
# taking turns), about a minute on a 2-core CPU with the default model, the server's start included.
QUICK_SCENARIOS = ("single", "interleaved")
QUICK_RUN = ("the single scenario (one 10-tool group: a miss, then 3 hits) and interleaved (2 groups, each "
             "sent twice), 4 tokens per answer")
