//! Price-book tests. Every expected price is computed by hand in the comment next to it.

use super::*;
use crate::time::parse_instant;

fn t(s: &str) -> i64 {
    parse_instant(s).expect("test timestamp")
}

fn priced(l: Lookup) -> Quote {
    match l {
        Lookup::Priced(q) => q,
        Lookup::Unpriced(u) => panic!("expected a price, got {u:?}"),
    }
}

const BOOK: &str = r#"
version = "2026-11-r1"

[[price]]
model = "H100 SXM"
match = ["H100 80GB HBM3"]
kind = "on_demand"
usd_per_gpu_hour = "12.29"
source = "AWS p5.48xlarge 98.32 / 8"

[[price]]
model = "H100 SXM"
match = ["H100 80GB HBM3"]
kind = "committed"
usd_per_gpu_hour = "6.88"
effective_from = "2026-11-26T12:00:00Z"

[[price]]
model = "H100 SXM"
match = ["H100 80GB HBM3"]
kind = "on_prem"
cluster = "dc-1"
effective_from = 2026-11-01
on_prem = { capex_usd = "37500", years = 4, watts = "1250", pue = "1.3", usd_per_kwh = "0.10", overhead_pct = "25" }

[[price]]
model = "L4"
kind = "on_demand"
usd_per_gpu_hour = "0.80"

[[price]]
model = "L40S"
kind = "spot"
usd_per_gpu_hour = "1.10"

[[price]]
model = "A100 (any)"
match = ["A100"]
kind = "on_demand"
usd_per_gpu_hour = "3"

[[price]]
model = "A100 80GB SXM"
match = ["A100-SXM4-80GB"]
kind = "on_demand"
usd_per_gpu_hour = "4.10"
"#;

fn book() -> PriceBook {
    PriceBook::from_toml(BOOK).expect("book loads")
}

fn key<'a>(model: &'a str, mig: Option<&'a str>, cluster: Option<&'a str>) -> GpuKey<'a> {
    GpuKey { model_name: model, mig_profile: mig, cluster }
}

#[test]
fn on_prem_derivation_by_hand() {
    // capex 37500 / (4 × 8760 = 35040 h) = 1.070205479… -> 1.070205
    // power 1250 W / 1000 × 1.3 × 0.10 = 0.1625 exactly -> 0.162500
    // base 1.232705; overhead 25% = 0.30817625 -> 0.308176 (below half) ; total 1.540881
    let b = book();
    let e = b.entries().iter().find(|e| e.kind == PriceKind::OnPrem).expect("on-prem entry");
    let d = e.derivation.as_ref().expect("derivation");
    assert_eq!(d.capex_per_hour, Micros(1_070_205));
    assert_eq!(d.power_per_hour, Micros(162_500));
    assert_eq!(d.overhead_per_hour, Micros(308_176));
    assert_eq!(d.total_per_hour, Micros(1_540_881));
    assert_eq!(e.usd_per_gpu_hour, Micros(1_540_881));
    assert!(d.to_string().contains("1.540881"), "{d}");
}

#[test]
fn price_change_boundary_and_next_change() {
    let b = book();
    let k = key("NVIDIA H100 80GB HBM3", None, None);
    let before = priced(b.price_at(&k, t("2026-11-26T11:59:59Z")).expect("lookup"));
    assert_eq!(before.usd_per_gpu_hour, Micros(12_290_000));
    assert_eq!(before.kind, PriceKind::OnDemand);
    assert_eq!(before.next_change_us, Some(t("2026-11-26T12:00:00Z")));
    let at = priced(b.price_at(&k, t("2026-11-26T12:00:00Z")).expect("lookup"));
    assert_eq!(at.usd_per_gpu_hour, Micros(6_880_000));
    assert_eq!(at.next_change_us, None);
}

#[test]
fn cluster_override_applies_from_its_start_only_in_its_cluster() {
    let b = book();
    let dc = key("NVIDIA H100 80GB HBM3", None, Some("dc-1"));
    let early = priced(b.price_at(&dc, t("2026-10-31T23:00:00Z")).expect("lookup"));
    assert_eq!(early.usd_per_gpu_hour, Micros(12_290_000)); // global before the override starts
    assert_eq!(early.next_change_us, Some(t("2026-11-01T00:00:00Z")));
    let late = priced(b.price_at(&dc, t("2026-11-27T00:00:00Z")).expect("lookup"));
    assert_eq!(late.usd_per_gpu_hour, Micros(1_540_881)); // the override beats the later global entry
    let other =
        priced(b.price_at(&key("NVIDIA H100 80GB HBM3", None, Some("eu")), t("2026-11-27T00:00:00Z")).expect("x"));
    assert_eq!(other.usd_per_gpu_hour, Micros(6_880_000));
}

#[test]
fn matching_is_case_insensitive_at_word_boundaries_longest_wins() {
    let b = book();
    let at = t("2026-11-20T00:00:00Z");
    let p = |name: &str| b.price_at(&key(name, None, None), at).expect("lookup");
    assert_eq!(priced(p("NVIDIA L4")).usd_per_gpu_hour, Micros(800_000));
    assert_eq!(priced(p("nvidia l40s")).usd_per_gpu_hour, Micros(1_100_000)); // not L4
    assert_eq!(priced(p("NVIDIA A100-SXM4-80GB")).model, "A100 80GB SXM"); // 14 chars beat "a100"
    assert_eq!(priced(p("NVIDIA A100-PCIE-40GB")).model, "A100 (any)");
    assert_eq!(
        p("NVIDIA L40"),
        Lookup::Unpriced(Unpriced::UnknownModel { model_name: "NVIDIA L40".into() }),
        "L40 is neither L4 nor L40S"
    );
    assert!(matches_at_boundary("nvidia h100 80gb hbm3 mig 1g.10gb", "h100 80gb hbm3"));
    assert!(!matches_at_boundary("nvidia a100-sxm4", "a10"));
}

#[test]
fn equal_length_matches_of_two_models_are_a_config_error() {
    let b = PriceBook::from_toml(
        r#"version = "v"
[[price]]
model = "x"
match = ["H100 80GB"]
kind = "spot"
usd_per_gpu_hour = "1"
[[price]]
model = "y"
match = ["80GB HBM3"]
kind = "spot"
usd_per_gpu_hour = "2"
"#,
    )
    .expect("loads: the tie only shows for some names");
    let err = b.price_at(&key("NVIDIA H100 80GB HBM3", None, None), 0).expect_err("ambiguous");
    assert!(matches!(err, PriceBookError::AmbiguousMatch { len: 9, .. }), "{err}");
    assert!(matches!(b.price_at(&key("H100 80GB PCIe", None, None), 0), Ok(Lookup::Priced(_))));
}

#[test]
fn mig_slices_are_priced_by_compute_share() {
    let b = book();
    let at = t("2026-11-20T00:00:00Z");
    let p = |mig: &str| b.price_at(&key("NVIDIA H100 80GB HBM3", Some(mig), None), at).expect("lookup");
    // 12.29 / 7 = 1.755714285… -> 1.755714
    let q = priced(p("1g.10gb"));
    assert_eq!(
        (q.usd_per_gpu_hour, q.full_gpu_usd_per_gpu_hour, q.mig_slices),
        (Micros(1_755_714), Micros(12_290_000), Some(1))
    );
    // 3 × 12.29 / 7 = 36.87 / 7 = 5.267142857… -> 5.267143
    assert_eq!(priced(p("3g.40gb")).usd_per_gpu_hour, Micros(5_267_143));
    assert_eq!(priced(p("7g.80gb")).usd_per_gpu_hour, Micros(12_290_000));
    assert_eq!(priced(p("1c.3g.40gb")).usd_per_gpu_hour, Micros(1_755_714));
    assert_eq!(p("8g.90gb"), Lookup::Unpriced(Unpriced::UnknownMigProfile { profile: "8g.90gb".into() }));
    assert_eq!(mig_slices("MIG 2g.20gb"), Some(2));
    for bad in ["", "g.10gb", "0g.5gb", "1g", "all-1g.12gb", "4c.3g.40gb"] {
        assert_eq!(mig_slices(bad), None, "{bad:?}");
    }
}

#[test]
fn unknown_models_and_not_yet_in_force_are_explicit() {
    let b = PriceBook::from_toml(
        "version = \"v\"\n[[price]]\nmodel = \"T4\"\nmatch = [\"Tesla T4\"]\nkind = \"spot\"\nusd_per_gpu_hour = \"0.2\"\neffective_from = \"2026-01-01\"\n",
    )
    .expect("loads");
    assert_eq!(
        b.price_at(&key("Tesla T4", None, None), t("2025-12-31T23:59:59Z")).expect("lookup"),
        Lookup::Unpriced(Unpriced::NotYetInForce { model: "T4".into(), first_us: t("2026-01-01") })
    );
    assert!(matches!(
        b.price_at(&key("NVIDIA B200", None, None), 0).expect("lookup"),
        Lookup::Unpriced(Unpriced::UnknownModel { .. })
    ));
}

#[test]
fn toml_is_strict() {
    let base = "version = \"v\"\n[[price]]\nmodel = \"T4\"\nkind = \"spot\"\n";
    let ok = format!("{base}usd_per_gpu_hour = \"0.35\"\n");
    assert!(PriceBook::from_toml(&ok).is_ok());
    for (bad, why) in [
        (format!("{base}usd_per_gpu_hour = 0.35\n"), "float refused"),
        (format!("{base}usd_per_gpu_hour = \"0.35\"\ncolour = \"red\"\n"), "unknown field"),
        (ok.replace("version = \"v\"\n", ""), "version required"),
        (ok.replace("version = \"v\"", "version = \" \""), "empty version"),
        (format!("{base}usd_per_gpu_hour = \"-1\"\n"), "negative"),
        (base.to_owned(), "no price"),
        (format!("{base}usd_per_gpu_hour = \"1\"\neffective_from = \"soon\"\n"), "bad date"),
        (format!("{ok}[[price]]\nmodel = \"T4\"\nkind = \"spot\"\nusd_per_gpu_hour = \"1\"\n"), "duplicate start"),
        (
            format!("{ok}[[price]]\nmodel = \"Other\"\nmatch = [\"t4\"]\nkind = \"spot\"\nusd_per_gpu_hour = \"1\"\n"),
            "dup matcher",
        ),
        (ok.replace("kind = \"spot\"", "kind = \"on_prem\""), "on_prem without inputs"),
    ] {
        assert!(PriceBook::from_toml(&bad).is_err(), "{why}: {bad}");
    }
}

#[test]
fn price_table_prints_every_entry() {
    let b = book();
    let table = b.table();
    assert_eq!(table.len(), 7);
    let text = b.render_table();
    assert!(text.starts_with("price book 2026-11-r1\n"), "{text}");
    assert!(text.contains("12.290000") && text.contains("1.540881") && text.contains("2026-11-26T12:00:00Z"), "{text}");
}

const SKY: &str = "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice
cpu_4x_general,,,4.0,16.0,0.2,us-east-1,,
gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,\"{'Gpus': [{'Name': 'H100', 'Count': 8.0}]}\",
gpu_1x_h100_pcie,H100,1.0,26.0,200.0,2.49,us-west-1,,
p5.48xlarge,H100,8,192,2048,98.32,us-east-1,,39.3
a3-megagpu-8g,H100-MEGA,8,208,1872,88.25,us-central1,,
gpu_3x_l4,L4,3,12,48,10,us-east-1,,
gpu_1x_4090,RTX4090,1,8,32,0.5,us-east-1,,
gpu_1x_4090b,RTX4090,1,8,32,0.6,us-east-1,,
";

#[test]
fn skypilot_import_cheapest_per_gpu() {
    let opts = SkyPilotImport { price: SkyPilotPrice::OnDemand, region: None, cluster: None, effective_from_us: None };
    let out = import_skypilot_csv(SKY, &opts).expect("import");
    let by = |m: &str| out.entries.iter().find(|e| e.model == m).map(|e| e.usd_per_gpu_hour);
    // H100 per GPU: 23.92/8 = 2.99, 2.49/1 = 2.49, 98.32/8 = 12.29, (MEGA) 88.25/8 = 11.03125 -> cheapest 2.49
    assert_eq!(by("H100"), Some(Micros(2_490_000)));
    // L4: 10 / 3 = 3.333333… -> 3.333333
    assert_eq!(by("L4"), Some(Micros(3_333_333)));
    assert_eq!(out.unmapped.get("RTX4090"), Some(&2));
    assert_eq!(out.entries.len(), 2);
    // Regional: us-east-1 H100 rows are 2.99 and 12.29 -> 2.99.
    let east = SkyPilotImport { region: Some("us-east-1".into()), ..opts.clone() };
    let out = import_skypilot_csv(SKY, &east).expect("import");
    assert_eq!(out.entries.iter().find(|e| e.model == "H100").map(|e| e.usd_per_gpu_hour), Some(Micros(2_990_000)));
    // Spot: only p5 has a SpotPrice: 39.3 / 8 = 4.9125.
    let spot = SkyPilotImport { price: SkyPilotPrice::Spot, ..opts };
    let out = import_skypilot_csv(SKY, &spot).expect("import");
    assert_eq!(out.entries.len(), 1);
    assert_eq!((out.entries[0].usd_per_gpu_hour, out.entries[0].kind), (Micros(4_912_500), PriceKind::Spot));
    // The imported entries form a valid book, and round-trip through TOML.
    let text = PriceBook::entries_to_toml(&out.entries);
    let b = PriceBook::from_toml(&format!("version = \"sky\"\n{text}")).expect("round trip");
    let q = priced(b.price_at(&key("NVIDIA H100 80GB HBM3", None, None), 0).expect("lookup"));
    assert_eq!(q.usd_per_gpu_hour, Micros(4_912_500));
}

#[test]
fn skypilot_import_refuses_bad_input() {
    let opts = SkyPilotImport { price: SkyPilotPrice::OnDemand, region: None, cluster: None, effective_from_us: None };
    assert!(matches!(import_skypilot_csv("InstanceType,Price\nx,1\n", &opts), Err(PriceBookError::MissingColumn(_))));
    let zero = "AcceleratorName,AcceleratorCount,Price,Region,SpotPrice\nH100,0,1,r,\n";
    assert!(matches!(import_skypilot_csv(zero, &opts), Err(PriceBookError::CsvRow { .. })));
    let junk = "AcceleratorName,AcceleratorCount,Price,Region,SpotPrice\nH100,8,1e3,r,\n";
    assert!(matches!(import_skypilot_csv(junk, &opts), Err(PriceBookError::CsvRow { .. })));
}
