"""kiln.settings: environment parsing, loud failures, to_env round trip."""

import pytest

from kiln.settings import Settings, SettingsError


def test_empty_environment_gives_documented_defaults():
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.default_concurrency == 8  # contract §2 step 5 / §8
    assert settings.catalog_file is None and settings.aws_endpoint_url is None


def test_explicit_env_mapping_ignores_process_environment(monkeypatch):
    monkeypatch.setenv("KILN_KEYS_TABLE", "from-process")
    assert Settings.from_env({}).keys_table == "kiln-keys"
    assert Settings.from_env().keys_table == "from-process"


def test_values_are_parsed_and_stripped():
    settings = Settings.from_env(
        {
            "KILN_KEYS_TABLE": "  keys-prod  ",
            "KILN_DEFAULT_CONCURRENCY": " 3 ",
            "KILN_KEEPALIVE_SECONDS": "2.5",
            "KILN_MAX_BODY_BYTES": "1024",
            "KILN_CATALOG_FILE": "/etc/catalog.json",
        }
    )
    assert settings.keys_table == "keys-prod"
    assert settings.default_concurrency == 3
    assert settings.keepalive_seconds == 2.5
    assert settings.max_body_bytes == 1024
    assert settings.catalog_file == "/etc/catalog.json"


def test_blank_optional_and_numeric_values_fall_back_to_defaults():
    settings = Settings.from_env({"KILN_CATALOG_FILE": "   ", "KILN_AUTH_CACHE_SECONDS": "", "KILN_STORAGE_RETRY_ATTEMPTS": " "})
    assert settings.catalog_file is None
    assert settings.auth_cache_seconds == Settings().auth_cache_seconds
    assert settings.storage_retry_attempts == Settings().storage_retry_attempts


def test_region_and_endpoint_precedence():
    env = {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "ap-south-1", "AWS_ENDPOINT_URL": "http://generic"}
    assert Settings.from_env(env).region == "eu-west-1"
    assert Settings.from_env({"AWS_DEFAULT_REGION": "ap-south-1"}).region == "ap-south-1"
    assert Settings.from_env(env).aws_endpoint_url == "http://generic"
    env["KILN_AWS_ENDPOINT_URL"] = "http://kiln-specific"
    assert Settings.from_env(env).aws_endpoint_url == "http://kiln-specific"


@pytest.mark.parametrize(
    "name, raw",
    [
        ("KILN_DEFAULT_CONCURRENCY", "0"),
        ("KILN_DEFAULT_CONCURRENCY", "eight"),
        ("KILN_DEFAULT_CONCURRENCY", "8.5"),
        ("KILN_MAX_BODY_BYTES", "-1"),
        ("KILN_STORAGE_RETRY_ATTEMPTS", "0"),
        ("KILN_LEASE_RENEW_SECONDS", "60"),  # not below the default lease TTL
        ("KILN_MAINTENANCE_RETRY_AFTER_SECONDS", "-5"),
        ("KILN_KEEPALIVE_SECONDS", "0"),
        ("KILN_LEASE_TTL_SECONDS", "soon"),
        ("KILN_AUTH_CACHE_SECONDS", "-0.5"),
        ("KILN_CATALOG_CACHE_SECONDS", "nan"),
        ("KILN_KEYS_TABLE", "   "),
        ("KILN_MAINTENANCE_PARAMETER", ""),
    ],
)
def test_bad_value_fails_loudly_naming_the_variable(name, raw):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: raw})


def test_settings_error_is_a_value_error():
    assert issubclass(SettingsError, ValueError)


def test_to_env_round_trips_non_default_settings():
    custom = Settings(
        keys_table="k",
        orgs_table="o",
        usage_table="u",
        maintenance_parameter="/m",
        catalog_parameter="/c",
        catalog_file="/tmp/catalog.json",
        region="eu-central-1",
        aws_endpoint_url="http://127.0.0.1:4566",
        maintenance_cache_seconds=0.25,
        catalog_cache_seconds=0.0,
        auth_cache_seconds=1.5,
        lease_ttl_seconds=30.0,
        keepalive_seconds=0.1,
        max_body_bytes=4096,
        maintenance_retry_after_seconds=0,
        storage_retry_attempts=2,
        default_concurrency=1,
    )
    assert Settings.from_env(custom.to_env()) == custom


def test_to_env_round_trips_defaults_and_omits_unset_optionals():
    env = Settings().to_env()
    assert "KILN_CATALOG_FILE" not in env and "KILN_AWS_ENDPOINT_URL" not in env
    assert env["AWS_REGION"] == "us-east-1"
    assert all(isinstance(value, str) for value in env.values())
    assert Settings.from_env(env) == Settings()


def test_the_readmes_configuration_table_is_the_declarations():
    from pathlib import Path

    from kiln.settings import markdown_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("| variable | default | meaning |")
    table = readme[start:readme.index("\n\n", start)]
    assert table == markdown_table(), "README.md's configuration table: paste kiln.settings.markdown_table()"


def test_every_declared_setting_is_read_from_its_variable():
    """Each declaration's variable, set to a value other than the default, changes that setting."""
    from dataclasses import fields

    from kiln.settings import variable

    for declared in fields(Settings):
        default = declared.default
        if isinstance(default, bool):
            raw, expected = ("false", False) if default else ("true", True)
        elif isinstance(default, int):
            raw, expected = str(default + 1), default + 1
        elif isinstance(default, float):
            expected = default / 2 if declared.name == "backend_error_rate" else default + 0.5
            raw = str(expected)
        else:
            raw = expected = f"/custom-{declared.name}"
        env = {variable(declared): raw}
        if declared.name == "lease_renew_seconds":
            env["KILN_LEASE_TTL_SECONDS"] = "100"
        assert getattr(Settings.from_env(env), declared.name) == expected, variable(declared)


def test_telemetry_variables_are_settings_too():
    settings = Settings.from_env({"POWERTOOLS_METRICS_DISABLED": "true", "POWERTOOLS_SERVICE_NAME": "gw",
                                  "POWERTOOLS_METRICS_NAMESPACE": "Ns"})
    assert (settings.metrics_disabled, settings.service_name, settings.metrics_namespace) == (True, "gw", "Ns")
    with pytest.raises(SettingsError, match="POWERTOOLS_METRICS_DISABLED"):
        Settings.from_env({"POWERTOOLS_METRICS_DISABLED": "perhaps"})
