"""What only the GRPO recipe needs: its config, prompts, seeded sampling, rewards, rollouts and loss."""
