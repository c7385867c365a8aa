"""Training: the optimizer's slots, the one step every path runs, Optimizer, value_and_grad and train_step."""
