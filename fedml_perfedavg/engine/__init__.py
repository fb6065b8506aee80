"""The batched single-process engine: a round's sampled clients train as one computation."""

from .batched import BatchedSimulation

__all__ = ["BatchedSimulation"]
