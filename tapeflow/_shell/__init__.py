"""The stateful shell: tensors, parameters, gradients, random draws, state cells, lazy recordings, Session."""
