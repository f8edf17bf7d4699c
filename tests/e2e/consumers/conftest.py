# These scripts run in the clients' own environments (tests/e2e/test_consumers.py starts them);
# importing them here, as --doctest-modules would, needs RewardBench and OpenRLHF in this one.
collect_ignore = ["openrlhf_rewards.py", "rewardbench_cli.py"]
