"""Pure logic (torch only, never vLLM): capture view, capture group, slots, plane labels."""

from .groups import CaptureGroup, GroupInfo, check_views_agree, resolve_capture_group
from .labels import PlaneLabels, plane_labels
from .layout import CaptureView, ViewOrder, describe_capture_view, gather_rows
from .slots import manager_slots, request_slots

__all__ = [
    "CaptureGroup",
    "CaptureView",
    "GroupInfo",
    "PlaneLabels",
    "ViewOrder",
    "check_views_agree",
    "describe_capture_view",
    "gather_rows",
    "plane_labels",
    "manager_slots",
    "resolve_capture_group",
    "request_slots",
]
