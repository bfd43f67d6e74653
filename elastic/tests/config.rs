//! `[elastic]` parsing, defaults, validation messages and duration accessors.

use std::time::Duration;

use elastic::{ElasticConfig, ElasticError};

#[test]
fn defaults_are_valid_and_documented_values() {
    let cfg = ElasticConfig::default();
    cfg.validate().unwrap();
    assert_eq!((cfg.min_nodes, cfg.max_nodes, cfg.max_restarts), (1, 0, 10));
    assert_eq!(cfg.heartbeat(), Duration::from_secs(1));
    assert_eq!(cfg.dead_after(), Duration::from_secs(5));
    assert_eq!(cfg.join_timeout(), Duration::from_secs(30));
    assert_eq!(cfg.grace(), Duration::from_secs(30));
}

#[test]
fn parses_partial_sections_and_refuses_unknown_keys() {
    let cfg: ElasticConfig =
        serde_json::from_str(r#"{"min_nodes": 2, "dead_after_s": 2.5}"#).unwrap();
    assert_eq!(cfg.min_nodes, 2);
    assert_eq!(cfg.dead_after(), Duration::from_millis(2500));
    assert_eq!(cfg.heartbeat_s, 1.0, "unset keys keep their defaults");
    let err = serde_json::from_str::<ElasticConfig>(r#"{"dead_after": 2}"#).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `dead_after`"),
        "{err}"
    );
    let back: ElasticConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_eq!(back, cfg);
}

#[test]
fn validation_names_the_key_and_the_reason() {
    let d = ElasticConfig::default;
    #[rustfmt::skip]
    let cases: Vec<(ElasticConfig, &str, &str)> = vec![
        (ElasticConfig { min_nodes: 0, ..d() }, "elastic.min_nodes", "at least 1"),
        (ElasticConfig { min_nodes: 3, max_nodes: 2, ..d() }, "elastic.max_nodes", "below elastic.min_nodes 3"),
        (ElasticConfig { heartbeat_s: 0.0, ..d() }, "elastic.heartbeat_s", "more than 0"),
        (ElasticConfig { heartbeat_s: f64::NAN, ..d() }, "elastic.heartbeat_s", "not a usable number"),
        (ElasticConfig { dead_after_s: f64::INFINITY, ..d() }, "elastic.dead_after_s", "finite"),
        (ElasticConfig { dead_after_s: 1.0, ..d() }, "elastic.dead_after_s", "must exceed elastic.heartbeat_s"),
        (ElasticConfig { heartbeat_s: 6.0, ..d() }, "elastic.dead_after_s", "must exceed elastic.heartbeat_s (6 s)"),
        (ElasticConfig { join_timeout_s: -1.0, ..d() }, "elastic.join_timeout_s", "0 or more"),
        (ElasticConfig { grace_s: -0.5, ..d() }, "elastic.grace_s", "0 or more"),
    ];
    for (cfg, key, why) in cases {
        let err = cfg.validate().unwrap_err();
        let ElasticError::InvalidConfig { key: got, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*got, key, "{err}");
        let text = err.to_string();
        assert!(text.contains(key) && text.contains(why), "{text}");
    }
    #[rustfmt::skip]
    let fine = [
        ElasticConfig { min_nodes: 3, max_nodes: 3, ..d() },
        ElasticConfig { max_nodes: 0, min_nodes: 8, ..d() },
        ElasticConfig { join_timeout_s: 0.0, grace_s: 0.0, max_restarts: 0, ..d() },
        ElasticConfig { heartbeat_s: 0.2, dead_after_s: 0.5, ..d() },
    ];
    for cfg in fine {
        cfg.validate().unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    }
}

#[test]
fn accessors_never_panic_on_invalid_values() {
    let cfg = ElasticConfig {
        heartbeat_s: -1.0,
        dead_after_s: f64::NAN,
        join_timeout_s: f64::INFINITY,
        grace_s: 1e300,
        ..ElasticConfig::default()
    };
    assert_eq!(cfg.heartbeat(), Duration::ZERO);
    assert_eq!(cfg.dead_after(), Duration::ZERO);
    // Not Duration::MAX: `Instant::now() + Duration::MAX` panics. Validation refuses these
    // values; the accessors clamp to the longest accepted duration.
    let longest = Duration::from_secs_f64(elastic::MAX_SECONDS);
    assert_eq!(cfg.join_timeout(), longest);
    assert_eq!(cfg.grace(), longest);
    assert!(std::time::Instant::now().checked_add(longest).is_some());
}
