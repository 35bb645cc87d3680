"""Tokenyard services: one subpackage per service, `python -m tokenyard.services.NAME`."""
