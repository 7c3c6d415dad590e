"""The scenarios' names, in the order they run: the command line lists them (options) without
importing the scenarios (the bench extra), and the registry (scenarios) is checked against them."""

SCENARIO_NAMES = ("single", "toolcount", "interleaved", "restart", "concurrent", "compile-overlap", "soak", "agent",
                  "history", "constrained", "fleet")
ONLY_WHEN_NAMED = ("history", "constrained", "fleet")
