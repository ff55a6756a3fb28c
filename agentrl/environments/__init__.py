"""Environments users already have: verifiers environments, OpenEnv servers and TRL environment classes.

Each library has its own adapter module here (``verifiers``, ``openenv``, ``trl``), imported only
when a run names that library, so agentrl imports without any of them installed.
"""
