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
        ("KILN_DEFAULT_CONCURRENCY", "501"),  # more than an org's item holds leases for
        ("KILN_MAX_BODY_BYTES", "-1"),
        ("KILN_STORAGE_RETRY_ATTEMPTS", "0"),
        ("KILN_LEASE_RENEW_SECONDS", "60"),  # not below the default lease TTL
        # above half of it: a renewal that fails has no room to be tried again before the lease
        # expires, and the request is stopped then (kiln.store.renewal)
        ("KILN_LEASE_RENEW_SECONDS", "30.5"),
        ("KILN_MAINTENANCE_RETRY_AFTER_SECONDS", "-5"),
        ("KILN_KEEPALIVE_SECONDS", "0"),
        ("KILN_LEASE_TTL_SECONDS", "soon"),
        # past what DynamoDB or the contract holds: accepted at start-up, they failed every
        # admission (an expiry of 1e+200) or every settle (an event's TTL of 45 digits)
        ("KILN_LEASE_TTL_SECONDS", "1e200"),
        ("KILN_LEASE_TTL_SECONDS", "91"),  # a dead gateway's slots free within 90 s (§4)
        ("KILN_USAGE_RETENTION_DAYS", "10000000000000000000000000000000000000000"),
        ("KILN_USAGE_RETENTION_DAYS", "-1"),
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
        lease_renew_seconds=10.0,
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
            env["KILN_LEASE_TTL_SECONDS"] = "90"
        assert getattr(Settings.from_env(env), declared.name) == expected, variable(declared)


def test_telemetry_variables_are_settings_too():
    settings = Settings.from_env({"POWERTOOLS_METRICS_DISABLED": "true", "POWERTOOLS_SERVICE_NAME": "gw",
                                  "POWERTOOLS_METRICS_NAMESPACE": "Ns"})
    assert (settings.metrics_disabled, settings.service_name, settings.metrics_namespace) == (True, "gw", "Ns")
    with pytest.raises(SettingsError, match="POWERTOOLS_METRICS_DISABLED"):
        Settings.from_env({"POWERTOOLS_METRICS_DISABLED": "perhaps"})


# -- every variable by its name, as deployments write it (template.yaml, docs/deploy.md) --------
# Written out here, not derived from the declarations: a variable renamed, or one no longer
# read, fails below, and a new setting fails until it has its line.

EVERY_VARIABLE = {
    # variable: (setting, raw value, parsed value), each value other than the default
    "KILN_KEYS_TABLE": ("keys_table", "keys-prod", "keys-prod"),
    "KILN_ORGS_TABLE": ("orgs_table", "orgs-prod", "orgs-prod"),
    "KILN_USAGE_TABLE": ("usage_table", "usage-prod", "usage-prod"),
    "KILN_MAINTENANCE_PARAMETER": ("maintenance_parameter", "/prod/maintenance", "/prod/maintenance"),
    "KILN_CATALOG_PARAMETER": ("catalog_parameter", "/prod/catalog", "/prod/catalog"),
    "KILN_CATALOG_FILE": ("catalog_file", "/etc/kiln/catalog.json", "/etc/kiln/catalog.json"),
    "AWS_REGION": ("region", "eu-west-1", "eu-west-1"),
    "KILN_AWS_ENDPOINT_URL": ("aws_endpoint_url", "http://127.0.0.1:4566", "http://127.0.0.1:4566"),
    "KILN_MAINTENANCE_CACHE_SECONDS": ("maintenance_cache_seconds", "60", 60.0),
    "KILN_CATALOG_CACHE_SECONDS": ("catalog_cache_seconds", "300", 300.0),
    "KILN_UPSTREAM_API_KEY_PARAMETER": ("upstream_api_key_parameter", "/prod/upstream-key", "/prod/upstream-key"),
    "KILN_UPSTREAM_API_KEY_CACHE_SECONDS": ("upstream_api_key_cache_seconds", "30", 30.0),
    "KILN_PARAMETER_FIRST_READ_SECONDS": ("parameter_first_read_seconds", "1.5", 1.5),
    "KILN_AUTH_CACHE_SECONDS": ("auth_cache_seconds", "2", 2.0),
    "KILN_LEASE_TTL_SECONDS": ("lease_ttl_seconds", "90", 90.0),
    "KILN_LEASE_RENEW_SECONDS": ("lease_renew_seconds", "30", 30.0),
    "KILN_KEEPALIVE_SECONDS": ("keepalive_seconds", "15", 15.0),
    "KILN_MAX_BODY_BYTES": ("max_body_bytes", "1048576", 1048576),
    "KILN_MAINTENANCE_RETRY_AFTER_SECONDS": ("maintenance_retry_after_seconds", "120", 120),
    "KILN_STORAGE_RETRY_ATTEMPTS": ("storage_retry_attempts", "5", 5),
    "KILN_STORAGE_RETRY_SECONDS": ("storage_retry_seconds", "2.5", 2.5),
    "KILN_ANSWER_DEADLINE_SECONDS": ("answer_deadline_seconds", "20", 20.0),
    "KILN_DEFAULT_CONCURRENCY": ("default_concurrency", "4", 4),
    "KILN_USAGE_RETENTION_DAYS": ("usage_retention_days", "400", 400),
    "KILN_BACKEND_FAILURE_THRESHOLD": ("backend_failure_threshold", "5", 5),
    "KILN_BACKEND_COOLDOWN_SECONDS": ("backend_cooldown_seconds", "2", 2.0),
    "KILN_BACKEND_MAX_COOLDOWN_SECONDS": ("backend_max_cooldown_seconds", "600", 600.0),
    "KILN_BACKEND_ERROR_WINDOW_SECONDS": ("backend_error_window_seconds", "30", 30.0),
    "KILN_BACKEND_ERROR_MIN_REQUESTS": ("backend_error_min_requests", "50", 50),
    "KILN_BACKEND_ERROR_RATE": ("backend_error_rate", "0.25", 0.25),
    "KILN_BACKEND_ERROR_MIN_CLIENTS": ("backend_error_min_clients", "3", 3),
    "POWERTOOLS_METRICS_DISABLED": ("metrics_disabled", "true", True),
    "POWERTOOLS_METRICS_NAMESPACE": ("metrics_namespace", "KilnProd", "KilnProd"),
    "POWERTOOLS_SERVICE_NAME": ("service_name", "kiln-prod", "kiln-prod"),
}
# read when the variable above is not set
FALLBACKS = {"AWS_DEFAULT_REGION": "AWS_REGION", "AWS_ENDPOINT_URL": "KILN_AWS_ENDPOINT_URL"}
DEFAULTS = vars(Settings.from_env({}))


def test_every_setting_has_its_variable_in_the_list():
    assert sorted(setting for setting, _, _ in EVERY_VARIABLE.values()) == sorted(DEFAULTS)
    for setting, _, parsed in EVERY_VARIABLE.values():
        assert DEFAULTS[setting] != parsed, f"{setting}: pick a value other than the default"


@pytest.mark.parametrize("name", sorted(EVERY_VARIABLE) + sorted(FALLBACKS))
def test_each_variable_alone_sets_its_setting_and_nothing_else(name):
    setting, raw, parsed = EVERY_VARIABLE[FALLBACKS.get(name, name)]
    settings = vars(Settings.from_env({name: raw}))
    assert settings == {**DEFAULTS, setting: parsed}


def test_every_variable_at_once():
    settings = Settings.from_env({name: raw for name, (_, raw, _) in EVERY_VARIABLE.items()})
    assert vars(settings) == {setting: parsed for setting, _, parsed in EVERY_VARIABLE.values()}
    assert Settings.from_env(settings.to_env()) == settings


@pytest.mark.parametrize("fallback, name", sorted(FALLBACKS.items()))
def test_a_variable_wins_over_its_fallback(fallback, name):
    setting, raw, parsed = EVERY_VARIABLE[name]
    assert getattr(Settings.from_env({name: raw, fallback: "other"}), setting) == parsed
    assert getattr(Settings.from_env({name: " ", fallback: raw}), setting) == parsed  # a blank one does not
