"""Where rollouts come from: tasks and environments, episodes, the producer, evaluation, SFT data, tasksets/."""
