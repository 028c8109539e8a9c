"""Post-training: RL config, loop and update, rollouts, the value model, the tasks and their
weighted mix, evaluation and `python -m rl`; objectives/ holds the losses and advantages,
rewards/ the reward interface (rule verifiers, a generative pairwise judge, Bradley-Terry)."""
