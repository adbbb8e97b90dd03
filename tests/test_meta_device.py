"""Building on the meta device without torch's reference ops (``petals.meta_device``): what the client's
local parts are built under."""

import torch

from petals.meta_device import NoReferenceOpsOnMeta


def test_a_range_is_made_on_the_cpu_so_that_buffers_computed_from_it_hold_values():
    with torch.device("meta"), NoReferenceOpsOnMeta():
        positions = torch.arange(4)
        weights = torch.nn.init.normal_(torch.empty(2, 2))
    assert positions.device.type == "cpu" and positions.tolist() == [0, 1, 2, 3]
    assert weights.is_meta


def test_a_range_joined_with_a_meta_tensor_gives_a_meta_tensor():
    # as a rotary embedding pads its frequencies with zeros made without a device (Gemma 4's proportional rope)
    with torch.device("meta"), NoReferenceOpsOnMeta():
        frequencies = torch.cat((1.0 / torch.arange(1, 3, dtype=torch.float), torch.zeros(2)), dim=0)
        on_cpu = torch.cat((torch.arange(2), torch.arange(2)))
    assert frequencies.is_meta and frequencies.shape == (4,)
    assert on_cpu.device.type == "cpu" and on_cpu.tolist() == [0, 1, 0, 1]
