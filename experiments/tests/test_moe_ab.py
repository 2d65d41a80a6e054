"""experiments/moe_ab.py's variant text parses into moe_layer arguments."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_variant_text_parses_into_layer_arguments():
    spec = importlib.util.spec_from_file_location("moe_ab", ROOT / "experiments" / "moe_ab.py")
    moe_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_ab)
    assert moe_ab.variant("base") == {}
    assert moe_ab.variant("half_tails=false+route_block=32") == {"half_tails": False, "route_block": 32}
