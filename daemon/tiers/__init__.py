"""Tiers below the pool: where evicted blocks go, and where lookups find them again."""

from kvoffload.daemon.tiers.base import BlockMeta, Tier, TierStats
from kvoffload.daemon.tiers.promote import Promoter

__all__ = ["BlockMeta", "Promoter", "Tier", "TierStats"]
