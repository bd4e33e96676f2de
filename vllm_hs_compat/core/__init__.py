"""Pure logic (torch only, never vLLM): capture view, capture group, slots, plane labels."""

from vllm_hs_compat.core.groups import CaptureGroup, GroupInfo, check_views_agree, resolve_capture_group
from vllm_hs_compat.core.labels import PlaneLabels, plane_labels
from vllm_hs_compat.core.layout import CaptureView, ViewOrder, describe_capture_view, gather_rows
from vllm_hs_compat.core.slots import request_slots, slots_for_view

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
    "request_slots",
    "resolve_capture_group",
    "slots_for_view",
]
