"""Observation encoders (RGB, voxelised point cloud, frozen text, state) and their cross-attention fusion."""

from diffpolicy.encoders.fusion import ObservationEncoder, StateEncoder
from diffpolicy.encoders.pointcloud import PointCloudEncoder, voxelize
from diffpolicy.encoders.rgb import RGBEncoder, random_shift
from diffpolicy.encoders.text import TextEncoder

__all__ = [
    "ObservationEncoder",
    "PointCloudEncoder",
    "RGBEncoder",
    "StateEncoder",
    "TextEncoder",
    "random_shift",
    "voxelize",
]
