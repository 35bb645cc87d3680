"""Autoscaling inside the power budget: how many prefill and decode workers run, and where."""
