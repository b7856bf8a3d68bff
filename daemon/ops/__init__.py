"""Operating the daemon: HTTP health and metrics, systemd notify, loop health, the stats summary."""
