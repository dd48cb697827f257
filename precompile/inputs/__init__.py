"""Inputs: what a recipe's ``inputs:`` names, turned into the plan's items (moved here from compiler/)."""
