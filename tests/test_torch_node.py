"""Tensors through the local engine: modules as nodes, the seeds' Body, the codec."""


import pytest
import torch
from models import Body, Head
from scenario import scenario
from torch import nn

from somatize import Graph, Opaque, codec
from somatize._keys import key_of_input
from somatize._values import codec_for
from somatize.torch import ModuleNode, from_blob, node, to_blob


def test_importing_somatize_imports_no_torch():
    code = "import somatize, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    scenario("-c", code, timeout=60)


def test_the_seeds_body_and_head_give_exactly_what_the_modules_give_by_hand():
    torch.manual_seed(0)
    body, head = Body(seed=None), Head(seed=None)
    g = Graph.somatize(body >> head)
    x = torch.randn(5, 8)
    assert torch.equal(g.forward(x), head.lin(body.lin(x).relu()))
    assert torch.equal(g.forward(Opaque(x)), head.lin(body.lin(x).relu()))


def test_the_seeds_graph_reads_ids_edges_placement_and_stages():
    from somatize import stages

    g = Graph.somatize(Body(seed=None).at("gpu") >> Head(seed=None))
    assert g.ids == ("body", "head")
    assert g.edges == (("body", "head"),)
    assert g.placement.get("body") == "gpu" and g.placement.get("head") is None
    assert stages(g, ["body"]) == [{"body"}, {"head"}]


def test_a_module_becomes_a_node_named_by_its_class_on_either_side():
    torch.manual_seed(0)
    lin, relu, out = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)
    g = Graph.somatize(node(lin) >> relu >> Head(seed=None))
    assert g.ids == ("linear", "relu", "head")
    assert isinstance(g["relu"], ModuleNode)
    g2 = Graph.somatize(nn.Linear(8, 8) >> Body(seed=None) >> out.__class__(6, 2))
    assert g2.ids == ("linear", "body", "linear_2")
    x = torch.randn(3, 8)
    assert torch.equal(
        g2.forward(x), g2["linear_2"].module(g2["body"].lin(g2["linear"].module(x)).relu())
    )


def test_a_modules_parameters_are_the_nodes():
    lin = nn.Linear(3, 2)
    assert node(lin).parameters() == list(lin.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool, torch.uint8])
def test_the_tensor_codec_round_trips_exactly(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    back = from_blob(to_blob(t))
    assert back.dtype == dtype and torch.equal(back, t)
    assert torch.equal(from_blob(to_blob(t[:, 1:3])), t[:, 1:3])  # not contiguous
    assert from_blob(to_blob(torch.empty(0, 4))).shape == (0, 4)


def test_importing_somatize_torch_registers_the_tensor_codec():
    assert codec_for(torch.zeros(1)).kind == "tensor"


def test_a_codec_can_be_registered_for_another_type_and_names_it():
    class Box:
        def __init__(self, data):
            self.data = data

    from somatize import Blob

    codec("box", Box, dump=lambda b: Blob("U8", (len(b.data),), b.data),
          load=lambda blob: Box(bytes(blob.data)))
    assert key_of_input(Box(b"abc")) == key_of_input(Opaque(Box(b"abc")))
    assert key_of_input(Box(b"abc")) != key_of_input(Box(b"abd"))


def test_key_of_a_tensor_is_by_content_dtype_and_shape():
    t = torch.arange(6, dtype=torch.float32)
    assert key_of_input(t) == key_of_input(t.clone()) == key_of_input(Opaque(t))
    assert key_of_input(t) != key_of_input(t.reshape(2, 3))
    assert key_of_input(t) != key_of_input(t.double())
    assert key_of_input(t) != key_of_input(t + 1)
