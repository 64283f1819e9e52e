"""Correctness oracles shared by tests, jobs and the bench: the float64 reference, bitwise helpers, fuzz cases."""
