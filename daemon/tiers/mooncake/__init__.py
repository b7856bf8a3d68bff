"""The shared tier on a Mooncake Store cluster."""
