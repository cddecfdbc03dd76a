"""Adversarial tests: hostile inputs, broken peers and reload storms against real parts."""
