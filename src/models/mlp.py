"""A multilayer perceptron: feature vectors -> logits (the tabular task's model)."""

from torch import nn


def mlp(num_inputs: int, num_outputs: int, hidden_size: int = 64, num_layers: int = 2) -> nn.Sequential:
    """`num_layers` hidden layers of `hidden_size` units with ReLU, then a linear output layer."""
    layers: list[nn.Module] = []
    width = num_inputs
    for _ in range(num_layers):
        layers += [nn.Linear(width, hidden_size), nn.ReLU()]
        width = hidden_size
    return nn.Sequential(*layers, nn.Linear(width, num_outputs))
