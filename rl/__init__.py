"""Post-training: RL config, loop and update, rollouts, the value model, rewards, evaluation and
`python -m rl`; objectives/ holds the losses and advantages."""
