"""How the engine waits for its GPU (handler.cuda_sync, handler.cuda_spin_us): parsed and
resolved on any machine; the waits themselves run in tests/test_cuda_runner.py on a GPU."""
import pytest

from handlers.config import parse_config
from handlers.errors import ConfigError
from handlers.run.cuda import cuda_wait


@pytest.mark.parametrize("mode", ["spin", "block", "hybrid"])
def test_a_configured_wait_wins_over_auto(mode):
    assert cuda_wait(mode) == mode


def test_hybrid_and_its_spin_parse():
    c = parse_config({"handler": {"cuda_sync": "hybrid", "cuda_spin_us": 120}})
    assert (c.cuda_sync, c.cuda_spin_us) == ("hybrid", 120.0)


@pytest.mark.parametrize("bad,words", [({"cuda_sync": "poll"}, "hybrid"),
                                       ({"cuda_spin_us": -5}, "microseconds"),
                                       ({"cuda_spin_us": "soon"}, "number")])
def test_bad_wait_settings_say_what_is_expected(bad, words):
    with pytest.raises(ConfigError, match=words):
        parse_config({"handler": bad})
