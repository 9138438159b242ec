"""Helpers of the test suite: oracles, fault injection, child processes and shared parametrization."""
