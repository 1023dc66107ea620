//! The derivation on synthetic measurements that a known profile implies (the cost
//! model's formulas run forwards), the written text read back, `--base` merging, and
//! bad measurements refused.

use std::path::Path;

use super::*;

const MIB: f64 = (1u64 << 20) as f64;
const SIZES: [f64; 5] = [1.0, 4.0, 16.0, 64.0, 256.0];

fn shipped(name: &str) -> Profile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hardware")
        .join(name);
    crate::hardware::from_file(&path).unwrap()
}

/// The figures the synthetic measurements are made from: four significant digits or
/// fewer, and none equal to the shipped profiles'.
fn truth() -> Profile {
    let mut p = Profile::neutral("truth");
    for (k, v) in [
        ("gpus_per_node", 4.0),
        ("compute.gemm_tflops", 700.0),
        ("compute.fp32_tflops", 45.0),
        ("memory.hbm_gbs", 2400.0),
        ("memory.kernel_us", 6.5),
        ("sync.event_us", 1.5),
        ("combine.gbs", 3700.0),
        ("copy_engine.peer_gbs", 300.0),
        ("copy_engine.local_gbs", 600.0),
        ("copy_engine.piece_us", 15.0),
        ("nvlink.base_us", 18.0),
        ("nvlink.hop_us", 3.5),
        ("nvlink.busbw_gbs.reduce_scatter", 220.0),
        ("nvlink.busbw_gbs.all_reduce", 280.0),
        ("nvlink.busbw_gbs.all_gather", 380.0),
        ("nvlink.busbw_gbs.broadcast", 390.0),
        ("nvlink.busbw_gbs.reduce", 230.0),
        ("interference.nccl.gemm_cost", 0.3),
        ("interference.nccl.stretch", 1.4),
        ("interference.combine.gemm_cost", 0.35),
        ("interference.combine.stretch", 4.5),
        ("interference.copy_engine.gemm_cost", 0.1),
        ("interference.copy_engine.stretch", 1.3),
        ("interference.copy_engine.local_stretch", 2.5),
        ("host.issue_us_per_node", 12.5),
    ] {
        assert!(p.set(k, v), "{k}");
    }
    p
}

/// A probe whose kernel takes `alone` seconds alone and `stretch` times that beside the
/// GEMMs, which lose `gemm_cost` per second of its work.
fn probe(what: &str, alone: f64, stretch: f64, gemm_cost: f64) -> BesideProbe {
    let work = 7.0 * alone;
    BesideProbe {
        what: what.into(),
        times: BesideTimes {
            gemms_alone_s: 9e-3,
            gemms_beside_s: 9e-3 + gemm_cost * work,
            op_alone_s: alone,
            op_beside_s: stretch * alone,
            work_beside_s: work,
        },
    }
}

/// What a calibration on `world` GPUs of the hardware `t` describes would measure.
fn synthetic(t: &Profile, world: u32) -> Measurements {
    let n = f64::from(world);
    let ops = 2.0 * 4096f64.powi(3);
    let step = 48.0 * ops / (t.gemm_tflops * 1e12);
    let combine_bytes = 3.0 * 32.0 * MIB;
    let numel = 4096.0 * 4096.0;
    let muon = f64::from(crate::simulate::muon_batch_launches(5)) * t.kernel_us * 1e-6
        + 5.0 * (6.0 * 4096f64.powi(3)) / (t.fp32_tflops * 1e12)
        + 5.0 * numel * 4.0 / (t.hbm_gbs * 1e9);
    let slot = 32.0 * MIB;
    let exchange = |m: f64| {
        let pieces = (m / slot).ceil().max(1.0);
        (n - 1.0)
            * (pieces * t.ce_piece_us * 1e-6
                + m / (t.ce_peer_gbs * 1e9)
                + m / (t.ce_local_gbs * 1e9))
    };
    let cross = (world >= 2).then(|| {
        let mut collectives = Vec::new();
        for kind in KINDS {
            let bw = t.get(busbw_key(kind)).unwrap();
            let steps = if kind == CollectiveKind::AllReduce {
                2.0 * (n - 1.0)
            } else {
                n - 1.0
            };
            for s in SIZES {
                let bytes = s * MIB;
                let factor = overlap::observe::bus_factor(kind, world);
                collectives.push(CollectiveSample {
                    kind,
                    bytes,
                    seconds: (t.nvlink_base_us + steps * t.nvlink_hop_us) * 1e-6
                        + bytes * factor / (bw * 1e9),
                });
            }
        }
        let exchanges = SIZES
            .iter()
            .map(|&s| ExchangeSample {
                message_bytes: s * MIB,
                pieces: (s * MIB / slot).ceil().max(1.0) as u32,
                seconds: exchange(s * MIB),
            })
            .collect();
        // The exchange beside the GEMMs copies out of the ring: that part stretches by
        // the local stretch, the rest by the peer copies'.
        let message = 64.0 * MIB / n;
        let whole = exchange(message);
        let out = (n - 1.0) * message / (t.ce_local_gbs * 1e9);
        let factor = ((whole - out) * t.copy_beside.stretch + out * t.copy_local_stretch) / whole;
        CrossGpu {
            collectives,
            exchanges,
            slot_bytes: slot as u64,
            nccl: probe(
                "a 64 MiB reduce-scatter",
                150e-6,
                t.nccl_beside.stretch,
                t.nccl_beside.gemm_cost,
            ),
            exchange: (
                probe("an exchange", whole, factor, t.copy_beside.gemm_cost),
                message,
            ),
        }
    });
    Measurements {
        env: Environment {
            gpu: "NVIDIA H200".into(),
            driver: "580.159.04".into(),
            nccl: "2.28.3".into(),
            date: "2026-12-05".into(),
            command: "overlap calibrate --out x.toml".into(),
            world,
            warmup: 3,
            iters: 10,
        },
        gemm: (16, 3, 4096, step),
        host_us_per_node: t.issue_us_per_node,
        combine: (
            combine_bytes,
            [1u32, 2, 4, 8]
                .iter()
                .map(|&p| {
                    let s =
                        t.kernel_us * 1e-6 + combine_bytes / f64::from(p) / (t.combine_gbs * 1e9);
                    (p, s)
                })
                .collect(),
        ),
        elementwise: SIZES
            .iter()
            .map(|&s| Sample {
                bytes: 2.0 * s * MIB,
                seconds: 3e-6 + 2.0 * s * MIB / (t.hbm_gbs * 1e9),
            })
            .collect(),
        local_copy: SIZES
            .iter()
            .map(|&s| Sample {
                bytes: s * MIB,
                seconds: 2e-6 + s * MIB / (t.ce_local_gbs * 1e9),
            })
            .collect(),
        muon: (4096, 4096, muon),
        event_gap: (2e-6 + t.event_us * 1e-6, 2e-6),
        combine_beside: probe(
            "a combine",
            33e-6,
            t.combine_beside.stretch,
            t.combine_beside.gemm_cost,
        ),
        local_copy_beside: probe("a copy", 52e-6, t.copy_local_stretch, 0.07),
        cross,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-3 * b.abs().max(1e-9)
}

#[test]
fn lines_and_two_figure_fits_recover_known_answers_and_refuse_what_cannot_be_fitted() {
    let l = fit_line(&[(1.0, 5.0), (2.0, 7.0), (4.0, 11.0)]).unwrap();
    assert!(
        (l.intercept - 3.0).abs() < 1e-12 && (l.slope - 2.0).abs() < 1e-12,
        "{l:?}"
    );
    assert!(l.rms < 1e-12);
    // Noise shows in the residual.
    let l = fit_line(&[(1.0, 5.0), (2.0, 7.5), (3.0, 9.0)]).unwrap();
    assert!(l.rms > 0.01 && (l.slope - 2.0).abs() < 1e-12, "{l:?}");
    for bad in [
        vec![(1.0, 2.0)],
        vec![(3.0, 1.0), (3.0, 2.0)],
        vec![(1.0, f64::NAN), (2.0, 1.0)],
    ] {
        assert!(fit_line(&bad).is_err(), "{bad:?}");
    }
    // y = 17.3e-6 · pieces + bytes / 358e9, pieces of 32 MiB slots.
    let pts: Vec<(f64, f64, f64)> = SIZES
        .iter()
        .map(|&s| {
            let (b, p) = (s * MIB, (s / 32.0).ceil().max(1.0));
            (p, b, 17.3e-6 * p + b / 358e9)
        })
        .collect();
    let (piece, inv, rms) = fit_two(&pts).unwrap();
    assert!(
        close(piece, 17.3e-6) && close(1.0 / inv / 1e9, 358.0),
        "{piece} {inv}"
    );
    assert!(rms < 1e-9);
    // Every message a whole number of slots: pieces and bytes are proportional.
    let prop: Vec<(f64, f64, f64)> = [1.0, 2.0, 4.0]
        .iter()
        .map(|&p| (p, p * 32.0 * MIB, p))
        .collect();
    assert!(fit_two(&prop).unwrap_err().contains("cannot be told apart"));
    assert!(fit_two(&[(1.0, 1.0, 1.0)]).is_err());
}

#[test]
fn every_measured_figure_of_a_two_gpu_profile_comes_back_from_its_own_measurements() {
    let t = truth();
    let c = derive(&synthetic(&t, 4), None, None).unwrap();
    assert_eq!(c.profile.name, "nvidia-h200-x4");
    for k in KEYS {
        let note = c.notes.iter().find(|n| n.key == k.path);
        if k.path.starts_with("network.") {
            assert!(note.is_none() && c.profile.network.is_none());
            continue;
        }
        if k.path == "host.launch_us" {
            // Optional and never measured: absent without a base.
            assert!(note.is_none() && c.profile.launch_us.is_none());
            continue;
        }
        let note = note.unwrap_or_else(|| panic!("no note for {}", k.path));
        let got = c.profile.get(k.path).unwrap();
        match k.path {
            "compute.backward_us_per_layer" => {
                assert_eq!(note.source, Source::Derived);
                let want = 3.0 * 2.0 * 4096f64.powi(3) / (c.profile.gemm_tflops * 1e12) * 1e6;
                assert!(close(got, want), "{got} {want}");
            }
            "copy_engine.concurrency" => {
                assert_eq!((note.source, got), (Source::Assumed, 1.0));
                assert!(note.text.contains("assumed 1"), "{}", note.text);
            }
            _ => {
                assert_eq!(note.source, Source::Measured, "{}", k.path);
                let want = t.get(k.path).unwrap();
                assert!(close(got, want), "{}: {got} against {want}", k.path);
            }
        }
        assert!(!note.text.is_empty());
    }
    // The comments name what was measured.
    let text = |key: &str| &c.notes.iter().find(|n| n.key == key).unwrap().text;
    assert!(text("nvlink.busbw_gbs.all_reduce").contains("1, 4, 16, 64 and 256 MiB"));
    assert!(text("nvlink.busbw_gbs.all_reduce").contains("10 timed after 3 untimed"));
    assert!(text("nvlink.busbw_gbs.all_reduce").contains("least squares"));
    assert!(text("copy_engine.peer_gbs").contains("slots of 32 MiB"));
    assert!(text("memory.kernel_us").contains("in 8"));
    assert!(text("interference.nccl.gemm_cost").starts_with("A 64 MiB reduce-scatter"));
}

#[test]
fn the_written_profile_parses_back_to_the_same_figures_and_simulates() {
    for (world, base) in [(4, None), (1, Some("h200-8x-400g.toml"))] {
        let b = base.map(shipped);
        let c = derive(
            &synthetic(&truth(), world),
            b.as_ref().map(|p| (p, "hardware/h200-8x-400g.toml")),
            Some("calibrated"),
        )
        .unwrap();
        let text = to_toml(&c);
        let back = crate::hardware::from_toml(&text, "calibrated.toml")
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back, c.profile, "{text}");
        back.check().unwrap();
        // Every key's line follows its comment; the header names the GPU, driver, NCCL
        // and the date.
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if l.contains(" = ") && !l.starts_with('#') {
                assert!(i > 0 && lines[i - 1].starts_with("# "), "{l}\n{text}");
            }
        }
        let header: String = lines
            .iter()
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches('#'))
            .collect();
        for part in ["NVIDIA H200", "580.159.04", "NCCL 2.28.3", "2026-12-05"] {
            assert!(header.contains(part), "{header}");
        }
        assert!(text.lines().all(|l| l.chars().count() <= 100), "{text}");
        assert_eq!(back.network.is_some(), base.is_some());
        // The simulator takes it: a step of two ranks.
        let config = overlap::Config::from_toml(
            "[mesh]\nshard = 2\nreplicate = 1\n[[param]]\nname = \"w\"\nshape = [1024, 1024]\nroute = \"fsdp\"\n",
            "inline",
        )
        .unwrap();
        let plan = overlap_graph::Planner::new(config.plan.clone())
            .unwrap()
            .plan(&[overlap_graph::Gate::On])
            .unwrap();
        let opts = crate::simulate::Options::default();
        let sim = crate::simulate::simulate(&plan, &back, &opts).unwrap();
        assert!(sim.span(0) > 0.0);
    }
}

#[test]
fn a_base_supplies_exactly_the_keys_the_job_cannot_measure() {
    let base = shipped("h200-8x-400g.toml");
    let t = truth();
    for world in [1, 4] {
        let c = derive(&synthetic(&t, world), Some((&base, "base.toml")), None).unwrap();
        let kept = unmeasured(world);
        assert!(kept.contains(&"copy_engine.concurrency") && kept.contains(&"network.nic_gbs"));
        assert_eq!(kept.contains(&"nvlink.base_us"), world == 1);
        for k in KEYS {
            let note = c.notes.iter().find(|n| n.key == k.path).unwrap();
            let (got, from_base) = (c.profile.get(k.path).unwrap(), base.get(k.path).unwrap());
            if kept.contains(&k.path) {
                assert_eq!(note.source, Source::Base, "{}", k.path);
                assert_eq!(got.to_bits(), from_base.to_bits(), "{}", k.path);
                assert!(
                    note.text.starts_with("Not measured") && note.text.contains("--base base.toml"),
                    "{}",
                    note.text
                );
            } else {
                assert_ne!(note.source, Source::Base, "{}", k.path);
                assert_ne!(got, from_base, "{} was not measured", k.path);
            }
        }
        assert_eq!(c.profile.network, base.network);
    }
    // On one GPU the reason is that one GPU cannot measure it.
    let c = derive(&synthetic(&t, 1), Some((&base, "b")), None).unwrap();
    let note = c.notes.iter().find(|n| n.key == "nvlink.hop_us").unwrap();
    assert!(
        note.text.contains("one GPU cannot measure it"),
        "{}",
        note.text
    );
    assert_eq!(c.profile.name, "nvidia-h200-x1");
}

#[test]
fn bad_jobs_and_measurements_are_refused_naming_what_is_wrong() {
    let t = truth();
    // One GPU without a base: every key it cannot measure is named.
    let e = derive(&synthetic(&t, 1), None, None)
        .unwrap_err()
        .to_string();
    for k in CROSS_GPU {
        assert!(e.contains(&format!("`{k}`")), "{k}: {e}");
    }
    assert!(e.contains("--base"), "{e}");
    assert!(check_job(1, Some(1), false).is_err());
    assert!(check_job(1, None, true).is_ok() && check_job(2, Some(2), false).is_ok());
    let e = check_job(4, Some(2), true).unwrap_err().to_string();
    assert!(
        e.contains("LOCAL_WORLD_SIZE") && e.contains("--nnodes 1"),
        "{e}"
    );
    // Times that do not grow with the size.
    let mut m = synthetic(&t, 2);
    for s in &mut m.elementwise {
        s.seconds = 1e-3 / s.bytes;
    }
    let e = derive(&m, None, None).unwrap_err().to_string();
    assert!(
        e.contains("`memory.hbm_gbs`") && e.contains("do not grow"),
        "{e}"
    );
    // A collective kind measured at one size only.
    let mut m = synthetic(&t, 2);
    if let Some(c) = &mut m.cross {
        c.collectives
            .retain(|s| s.kind != CollectiveKind::Broadcast || s.bytes == MIB);
    }
    let e = derive(&m, None, None).unwrap_err().to_string();
    assert!(
        e.contains("`nvlink.busbw_gbs.broadcast`") && e.contains("two or more"),
        "{e}"
    );
    // Not a number.
    let mut m = synthetic(&t, 2);
    m.local_copy[2].seconds = f64::NAN;
    let e = derive(&m, None, None).unwrap_err().to_string();
    assert!(e.contains("`copy_engine.local_gbs`"), "{e}");
    // Muon faster than its own memory traffic.
    let mut m = synthetic(&t, 2);
    m.muon.2 = 1e-6;
    let e = derive(&m, None, None).unwrap_err().to_string();
    assert!(e.contains("`compute.fp32_tflops`"), "{e}");
    // Exchanges all of whole slots: pieces and bytes cannot be told apart.
    let mut m = synthetic(&t, 2);
    if let Some(c) = &mut m.cross {
        c.exchanges.retain(|e| e.message_bytes >= 64.0 * MIB);
    }
    let e = derive(&m, None, None).unwrap_err().to_string();
    assert!(e.contains("`copy_engine.peer_gbs`"), "{e}");
    // Two GPUs without the cross-GPU measurements, and a bad name.
    let mut m = synthetic(&t, 2);
    m.cross = None;
    assert!(derive(&m, None, None).is_err());
    let e = derive(&synthetic(&t, 2), None, Some("a b"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--name"), "{e}");
}

#[test]
fn small_helpers() {
    assert_eq!(date_utc(0), "1970-01-01");
    assert_eq!(date_utc(1_700_000_000), "2023-11-14");
    assert_eq!(date_utc(951_782_400), "2000-02-29");
    assert_eq!(round4(241.83917), 241.8);
    assert_eq!(round4(123_456.0), 123_500.0);
    assert_eq!(round4(0.0012345), 0.001235);
    assert_eq!(round4(-7.06449), -7.064);
    assert_eq!(round4(0.0), 0.0);
    assert_eq!(default_name("NVIDIA H200", 2), "nvidia-h200-x2");
    assert_eq!(default_name("  ", 1), "gpu-x1");
    assert_eq!(size_text(64.0 * MIB), "64 MiB");
    assert_eq!(size_text(4096.0), "4 KiB");
    assert_eq!(size_text(100.0), "100 bytes");
    assert!(check_name("h200.calibrated_2-x").is_ok());
    for bad in ["", "a\"b", "a b", &"x".repeat(65)] {
        assert!(check_name(bad).is_err(), "{bad}");
    }
    let c = derive(&synthetic(&truth(), 2), None, None).unwrap();
    let s = summary(&c);
    for k in KEYS.iter().filter(|k| k.required) {
        assert!(s.contains(k.path), "{}", k.path);
    }
    assert!(s.contains("assumed") && s.contains("derived") && s.contains("measured"));
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(32))]

    /// The round trip as a property: any profile near the test's truth (every measured
    /// figure scaled by 0.5 to 2, a stretch's excess over 1 likewise), run forwards
    /// through the cost model into measurements, fits back to itself.
    #[test]
    fn any_profile_comes_back_from_the_measurements_it_predicts(
        factors in proptest::collection::vec(0.5f64..2.0, KEYS.len()),
    ) {
        let mut t = truth();
        let fixed = ["gpus_per_node", "copy_engine.concurrency", "host.launch_us", "compute.backward_us_per_layer"];
        for (k, f) in KEYS.iter().zip(&factors) {
            if fixed.contains(&k.path) || k.path.starts_with("network.") {
                continue;
            }
            let Some(v) = t.get(k.path) else { continue };
            let v = if k.path.ends_with("stretch") { 1.0 + (v - 1.0) * f } else { v * f };
            proptest::prop_assert!(t.set(k.path, round4(v)), "{}", k.path);
        }
        let c = derive(&synthetic(&t, 4), None, None).unwrap();
        for note in c.notes.iter().filter(|n| n.source == Source::Measured) {
            let (got, want) = (c.profile.get(note.key).unwrap(), t.get(note.key).unwrap());
            proptest::prop_assert!(close(got, want), "{}: {} against {}", note.key, got, want);
        }
    }
}
