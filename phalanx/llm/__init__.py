"""LLM post-training roles (layer 7): the DTensor policy worker, the driver-side Policy,
generation workers, refit between them and loss functions."""
