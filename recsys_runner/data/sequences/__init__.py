"""Histories in file data: list columns checked and truncated, token budgets that cut batches by history length, and an
interaction log turned into training rows with user histories."""
