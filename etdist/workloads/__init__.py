"""Workloads written as Event Tensor graphs with the public API, each with a torch reference."""
