use super::*;

fn config(name: &str, keys: &[&str], limits: TenantLimits) -> TenantConfig {
    TenantConfig {
        name: name.into(),
        keys: keys.iter().map(|k| k.to_string()).collect(),
        weight: 1.0,
        limits,
    }
}

fn record(name: &str, key: &str) -> TenantRecord {
    let key = KeyRecord::from_digest(&hex(&digest(key)), 1).unwrap();
    TenantRecord {
        name: name.into(),
        weight: 2.0,
        limits: TenantLimits::default(),
        keys: vec![key],
        incarnation: String::new(),
    }
}

#[test]
fn an_open_directory_makes_everyone_the_default_tenant() {
    let t = Tenants::default();
    assert!(!t.closed());
    assert_eq!(t.authenticate(None, "metadata").unwrap().tenant(), DEFAULT_TENANT);
    assert_eq!(t.authenticate(Some("anything"), "metadata").unwrap().tenant(), DEFAULT_TENANT);
}

#[test]
fn keys_find_their_tenant_by_digest() {
    let hashed = format!("sha256:{}", hex(&digest("kb")));
    let t = Tenants::new(
        vec!["plain".into()],
        vec![config("a", &["ka"], TenantLimits::default()), config("b", &[&hashed], TenantLimits::default())],
    )
    .unwrap();
    assert!(t.closed());
    assert_eq!(t.authenticate(Some("plain"), "header").unwrap().tenant(), DEFAULT_TENANT);
    assert_eq!(t.authenticate(Some("ka"), "header").unwrap().tenant(), "a");
    assert_eq!(t.authenticate(Some("kb"), "header").unwrap().tenant(), "b");
    assert!(t.authenticate(Some(&hashed), "header").is_err(), "the digest is not the key");
    let missing = t.authenticate(None, "header").unwrap_err();
    assert!(missing.to_string().contains("header"), "{missing}");
    assert_eq!(
        t.authenticate(Some("x"), "h").unwrap_err().class(),
        strata_common::ErrorClass::Unauthenticated
    );
    // One key, two tenants: refused at start.
    let clash = Tenants::new(
        vec![],
        vec![config("a", &["k"], Default::default()), config("b", &["k"], Default::default())],
    );
    assert!(clash.unwrap_err().to_string().contains("belongs to both"));
}

#[test]
fn registry_tenants_come_and_go_and_config_wins() {
    let t = Tenants::new(vec![], vec![config("a", &["ka"], TenantLimits::default())]).unwrap();
    let mut admin = BTreeMap::new();
    admin.insert("c".to_string(), record("c", "kc"));
    admin.insert("a".to_string(), record("a", "k-shadow"));
    admin.insert("d".to_string(), record("d", "ka")); // another tenant's key: left out
    t.follow(&admin, 1);
    assert_eq!(t.authenticate(Some("kc"), "h").unwrap().tenant(), "c");
    assert!(t.authenticate(Some("k-shadow"), "h").is_err(), "the configured tenant a is not replaced");
    assert_eq!(t.authenticate(Some("ka"), "h").unwrap().tenant(), "a");
    let owner =
        |name: &str, incarnation: &str| Owner { tenant: name.into(), incarnation: incarnation.into() };
    assert!(t.caller(&owner("d", "")).is_err());
    assert!(t.configured("a") && !t.configured("c"));
    admin.remove("c");
    t.follow(&admin, 1);
    assert!(t.authenticate(Some("kc"), "h").is_err(), "a deleted tenant's key stops working");
    // Made again under the same name: another owner; what the first one stored is not its.
    let first = t.authenticate(Some("ka"), "h").unwrap().owner();
    admin.insert("c".to_string(), TenantRecord { incarnation: "one".into(), ..record("c", "kc") });
    t.follow(&admin, 1);
    let c1 = t.authenticate(Some("kc"), "h").unwrap().owner();
    assert!(t.caller(&c1).is_ok());
    admin.insert("c".to_string(), TenantRecord { incarnation: "two".into(), ..record("c", "kc") });
    t.follow(&admin, 1);
    assert_ne!(t.authenticate(Some("kc"), "h").unwrap().owner(), c1);
    assert!(t.caller(&c1).is_err(), "the deleted incarnation's batches no longer run");
    assert!(t.caller(&first).is_ok(), "a configured tenant keeps its name");
}

#[test]
fn limiters_survive_rebuilds_and_follow_the_coordinator_count() {
    let limits = TenantLimits { max_concurrent: Some(2), models: vec!["m".into()], ..Default::default() };
    let t = Tenants::new(vec![], vec![config("a", &["ka"], limits)]).unwrap();
    let caller = t.authenticate(Some("ka"), "h").unwrap();
    assert!(caller.may_use("m").is_ok());
    assert_eq!(caller.may_use("other").unwrap_err().class(), strata_common::ErrorClass::PermissionDenied);
    let ask = Ask { prompt_tokens: 1, max_tokens: 1 };
    let first = caller.admit(ask).unwrap();
    t.follow(&BTreeMap::new(), 2); // a second coordinator: one stream each
    let again = t.authenticate(Some("ka"), "h").unwrap();
    assert!(again.admit(ask).is_err(), "the permit taken before the rebuild still counts");
    drop(first);
    assert!(again.admit(ask).is_ok());
    // Batch work is held to the tenant's rates but not to its streams in flight.
    let held = again.admit(ask).unwrap();
    assert!(again.admit(ask).is_err());
    assert!(again.clone().for_batch().admit(ask).is_ok(), "batch work takes no stream slot");
    drop(held);
}
