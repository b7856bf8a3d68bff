"""The control socket: its messages, the handlers behind them, clients' leases, authentication."""
