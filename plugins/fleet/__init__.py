"""The fleet head (``superfluid fleet``): SMG routes requests to superfluid nodes; the head adds
what SMG lacks for superfluid (placeholder until the fleet head lands)."""
