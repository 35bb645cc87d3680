"""Capacity planning: how many accelerators, racks and kW a model and a workload need."""

from tokenyard.planner.catalog import HARDWARE, MODELS, hardware, model
from tokenyard.planner.plan import Plan, PlanError, Workload, make_plan

__all__ = ["HARDWARE", "MODELS", "Plan", "PlanError", "Workload", "hardware", "make_plan", "model"]
