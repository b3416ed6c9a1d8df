"""Observation encoders (RGB, coloured voxelised point cloud, frozen text, state) and their cross-attention fusion."""

from diffpolicy.encoders.fusion import ObservationEncoder, StateEncoder
from diffpolicy.encoders.pointcloud import PointCloudEncoder
from diffpolicy.encoders.rgb import RGBEncoder, random_shift
from diffpolicy.encoders.text import TextEncoder

__all__ = [
    "ObservationEncoder",
    "PointCloudEncoder",
    "RGBEncoder",
    "StateEncoder",
    "TextEncoder",
    "random_shift",
]
