"""The handler options of model-config.yaml and the shipped logging configuration (in process)."""

import pytest

from handlers.config import parse_config
from handlers.errors import ConfigError


def test_config_parses_and_rejects_with_fix():
    c = parse_config({"deviceType": "gpu", "handler": {"stream_priority": -1, "warmup": "false"}})
    assert c.device_type == "gpu" and c.stream_priority == -1 and c.warmup is False
    with pytest.raises(ConfigError, match="unknown handler option.*strem_priority.*valid options"):
        parse_config({"handler": {"strem_priority": 1}})
    with pytest.raises(ConfigError, match="max_rows_per_request.*integer"):
        parse_config({"handler": {"max_rows_per_request": "lots"}})
    with pytest.raises(ConfigError, match="deviceType"):
        parse_config({"deviceType": "neuron"})
    assert parse_config({"handler": {"staging_piece_mb": 0}}).staging_piece_mb == 0.0
    assert parse_config({}).float32_matmul_precision == "highest"
    with pytest.raises(ConfigError, match="float32_matmul_precision.*highest.*high.*medium"):
        parse_config({"handler": {"float32_matmul_precision": "tf32"}})
    with pytest.raises(ConfigError, match=r"staging_piece_mb = -2 is invalid: expected a number of at least 0 .*"
                                          r"Fix: cs-archive --handler-option staging_piece_mb=VALUE, or leave it out for 0"):
        parse_config({"handler": {"staging_piece_mb": -2}})
    assert parse_config({}).stage_metrics_s == 1.0 and parse_config({"handler": {"stage_metrics_s": 0}}).stage_metrics_s == 0
    with pytest.raises(ConfigError, match="stage_metrics_s = -1 is invalid: expected a number of at least 0"):
        parse_config({"handler": {"stage_metrics_s": -1}})
    with pytest.raises(ConfigError, match="deviceIds = \\[-1\\] is invalid: .* at the top level"):
        parse_config({"deviceIds": [-1]})
    assert parse_config({"deviceIds": [0, 2]}).device_ids == (0, 2)
    with pytest.raises(ConfigError, match="max_json_mb = 0 is invalid: expected a number above 0"):
        parse_config({"handler": {"max_json_mb": 0}})


def test_each_option_is_declared_once_and_the_docs_table_is_printed_from_the_declarations():
    """handlers/config.OPTIONS drives the typed config, the parser and the options table of
    docs/configuration.md: the page holds exactly the table `python -m handlers.config` prints;
    every declared default parses back to itself and is what HandlerConfig() holds; no module
    of the package reads model-config keys itself."""
    import dataclasses
    import re
    import subprocess
    import sys
    from pathlib import Path

    from handlers import config

    root = Path(__file__).resolve().parents[1]
    printed = subprocess.run([sys.executable, "-m", "handlers.config"], capture_output=True, text=True,
                             check=True, cwd=root).stdout.strip()
    page = (root / "docs" / "configuration.md").read_text()
    table = re.search(r"<!-- options table: python -m handlers.config -->\n(.*?)\n<!-- end of options table -->",
                      page, re.S)
    assert table and table.group(1).strip() == printed
    assert [f.name for f in dataclasses.fields(config.HandlerConfig)] == [o.name for o in config.OPTIONS]
    defaults = config.HandlerConfig()
    for o in config.OPTIONS:
        assert getattr(defaults, o.name) == o.default, o.name
        assert f"`{o.key.split(',')[0] if o.key else o.name}`" in printed
        if not o.torchserve and o.default is not None:
            back = o.default if o.kind is not tuple else list(o.default)
            assert getattr(parse_config({"handler": {o.name: back}}), o.name) == o.default, o.name
    # the model-config keys are read in handlers/config.py alone
    readers = [p for p in (root / "handlers").rglob("*.py") if p.name != "config.py" and re.search(
        r"model_yaml_config|\b(maxWorkers|minWorkers|deviceIds|deviceType)\b\"|getattr\(config, \"", p.read_text())]
    # startup.py passes the YAML to parse_config; the guardian reads the worker counts of the management
    # API's description of the model (to scale it back to them), not model-config
    assert [p.relative_to(root).as_posix() for p in readers] == ["handlers/startup.py",
                                                                 "handlers/torchserve/guardian_main.py"]


def test_shipped_log4j2_xml_is_well_formed_and_named_by_both_configs():
    """log4j falls back to logging nothing useful when its file does not parse (and says so only
    on the frontend's stdout), so the file must parse; both configs must name it."""
    import xml.etree.ElementTree as ET
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    loggers = {e.get("name"): e for e in ET.parse(root / "log4j2.xml").getroot().iter("Logger")}
    assert loggers["org.pytorch.serve"].get("level") == "info"
    assert loggers["ACCESS_LOG"].get("level") == "info"
    assert all(e.get("additivity") == "false" for e in loggers.values() if e.find("AppenderRef") is not None)
    assert "vmargs=-Dlog4j.configurationFile=log4j2.xml\n" in (root / "config.properties").read_text()
