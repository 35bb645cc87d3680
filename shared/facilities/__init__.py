"""Facilities: rack power and coolant limits, per-rack state, and what placement should do about it.

Pure parts only (policy, simulator, inventory, tracker); the service lives in
tokenyard.services.facilities.
"""
