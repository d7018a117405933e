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
    with pytest.raises(ConfigError, match="staging_piece_mb must be 0"):
        parse_config({"handler": {"staging_piece_mb": -2}})
    assert parse_config({}).stage_metrics_s == 1.0 and parse_config({"handler": {"stage_metrics_s": 0}}).stage_metrics_s == 0
    with pytest.raises(ConfigError, match="stage_metrics_s must be 0 .*or a positive number of seconds"):
        parse_config({"handler": {"stage_metrics_s": -1}})


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
