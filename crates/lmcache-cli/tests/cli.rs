//! The `lmcache-rs` binary as a user runs it.

use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lmcache-rs"))
}

#[test]
fn help_names_lmcache_flags() {
    let out = bin().args(["server", "--help"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--l1-size-gb",
        "--eviction-policy",
        "--eviction-trigger-watermark",
        "--shm-name",
        "--l1-devdax-path",
        "--no-l1-use-lazy",
        "--l1-warm-restart",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn bad_flags_are_refused_with_their_name() {
    let out = bin().args(["server", "--eviction-policy", "MRU"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MRU") && err.contains("LRU"), "{err}");
    let out = bin().args(["server", "--l1-size-gb", "-1"]).output().unwrap();
    assert!(!out.status.success());
    let out = bin().args(["server", "--l2-adapter", "{}"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("L2 adapter #0") && err.contains("type: missing"), "{err}");
    let out = bin()
        .args(["server", "--l2-adapter", r#"{"type":"fs","base_path":"/tmp/x","bogus":1}"#])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("bogus: unknown field"), "{err}");
    let out = bin().args(["server", "--l2-adapter", "not json"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--l2-adapter #0"), "{err}");
    let cfg = std::env::temp_dir().join(format!("lmcache-rs-bad-{}.toml", std::process::id()));
    std::fs::write(&cfg, "l1_size_gb = 1\nbogus_key = 3\n").unwrap();
    let out = bin().args(["server", "--config", cfg.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--bogus-key"), "{err}");
    std::fs::write(&cfg, "[[l2_adapter]]\ntype = \"fs\"\n").unwrap();
    let out = bin().args(["server", "--config", cfg.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("base_path: missing"), "{err}");
    let _ = std::fs::remove_file(&cfg);
    let out = bin().args(["server", "--isolated-ipc"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--isolated-ipc") && err.contains("not support"),
        "{err}"
    );
    // gRPC serves TCP only: a ZMQ endpoint as its host is refused by name.
    let out = bin()
        .args(["server", "--transport", "grpc", "--host", "ipc:///tmp/x", "--http-port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not a ipc:// endpoint"), "{err}");
    // The L1 file: combinations LMCache also refuses, flags that need it, and a file that
    // is not ours, left as it was.
    let dir = std::env::temp_dir().join(format!("lmcache-rs-devdax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("l1");
    let f = file.to_str().unwrap();
    for (args, named) in [
        (vec!["--l1-devdax-path", f, "--shm-name", "x"], "--shm-name"),
        (vec!["--l1-devdax-path", f, "--l1-use-hugepages"], "--l1-use-hugepages"),
        (vec!["--l1-warm-restart"], "--l1-devdax-path"),
        (vec!["--l1-devdax-format"], "--l1-devdax-path"),
        // A warm restart in shared memory: a valid name, no huge pages.
        (vec!["--l1-warm-restart", "--shm-name", "a/b"], "--shm-name"),
        (vec!["--l1-warm-restart", "--shm-name", "x", "--l1-use-hugepages"], "--l1-use-hugepages"),
        (vec!["--l1-devdax-format", "--shm-name", "x"], "--l1-warm-restart"),
    ] {
        let out = bin().arg("server").args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(named), "{args:?}: {err}");
    }
    assert!(!file.exists(), "nothing was created by a refused command line");
    std::fs::write(&file, b"someone else's bytes").unwrap();
    let out = bin()
        .args(["server", "--port", "0", "--http-port", "0", "--l1-size-gb", "0.1"])
        .args(["--l1-devdax-path", f, "--no-l1-use-lazy", "--l1-warm-restart"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not an lmcache-rs L1") && err.contains(f),
        "{err}"
    );
    assert_eq!(err.matches("not an lmcache-rs L1").count(), 1, "said once: {err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"someone else's bytes");
    // A DAX L2 on the L1's own file would write over L1's bytes: refused by name, as LMCache's
    // add_l2_adapter refuses a device an L1 maps ("already mapped by L1").
    let shared = dir.join("l1-and-l2");
    let g = shared.to_str().unwrap();
    let out = bin()
        .args(["server", "--port", "0", "--http-port", "0", "--l1-size-gb", "0.05"])
        .args(["--l1-devdax-path", g, "--no-l1-use-lazy", "--shm-name", ""])
        .args(["--l2-adapter"])
        .arg(format!(
            r#"{{"type":"dax","device_path":"{g}","max_dax_size_gb":0.05,"slot_bytes":1048576}}"#
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("(dax)") && err.contains(g) && err.contains("in use"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let out = bin().args(["server", "--worker-reap-timeout-seconds", "5"]).output().unwrap();
    assert!(!out.status.success());
    let out = bin().args(["server", "--no-such-flag"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
    // P2P needs a coordinator; mooncake_te is not built; nixl needs the wheel's library.
    let out = bin().args(["server", "--p2p-advertise-url", "127.0.0.1:7600"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--coordinator-url"), "{err}");
    let out = bin()
        .args(["server", "--p2p-advertise-url", "127.0.0.1:7600"])
        .args(["--coordinator-url", "http://127.0.0.1:1", "--p2p-transfer-engine", "mooncake_te"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("mooncake_te") && err.contains("native"),
        "{err}"
    );
    let out = bin()
        .args(["server", "--p2p-advertise-url", "127.0.0.1:7600"])
        .args(["--coordinator-url", "http://127.0.0.1:1", "--p2p-transfer-engine", "nixl"])
        .args(["--nixl-library", "/nonexistent/libnixl_capi.so"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no NIXL library at /nonexistent/libnixl_capi.so"),
        "{err}"
    );
    // trace replay takes the server's flags, but refuses by name those it has no use for.
    let out = bin()
        .args(["trace", "replay", "/nonexistent.lct", "--http-port", "9000"])
        .args(["--coordinator-url", "http://127.0.0.1:1", "--shm-name", "x"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for flag in ["--http-port", "--coordinator-url", "--shm-name", "does not use"] {
        assert!(err.contains(flag), "{flag} not named: {err}");
    }
    // Storage flags are used: the replay goes on to the file.
    let out = bin()
        .args(["trace", "replay", "/nonexistent.lct", "--l1-size-gb", "1"])
        .args(["--eviction-policy", "ARC"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("/nonexistent.lct"), "{err}");
    assert!(!err.contains("does not use"), "{err}");
}

#[test]
fn server_starts_fast_on_defaults_and_unlinks_its_segment_on_sigterm() {
    let name = format!("lmcache_rs_cli_test_{}", std::process::id());
    let (mut child, path) = spawn_until_segment(&name, &["--l1-size-gb", "1"]);
    nix_kill(child.id());
    let status = child.wait().unwrap();
    assert!(status.success(), "server exited with {status}");
    assert!(!path.exists(), "segment left behind after SIGTERM");
}

#[test]
fn exit_after_seconds_still_stops_on_sigterm_and_by_itself() {
    let wait_exit = |child: &mut std::process::Child, within: Duration| {
        let t0 = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if t0.elapsed() > within {
                let _ = child.kill();
                panic!("server still running after {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    for (exit_after, term) in [("600", true), ("1", false)] {
        let name = format!("lmcache_rs_cli_exit_{exit_after}_{}", std::process::id());
        let (mut child, path) = spawn_until_segment(
            &name,
            &["--l1-size-gb", "0.01", "--exit-after-seconds", exit_after],
        );
        if term {
            nix_kill(child.id());
        }
        let status = wait_exit(&mut child, Duration::from_secs(15));
        assert!(status.success(), "server exited with {status}");
        assert!(!path.exists(), "segment left behind");
    }
}

/// Starts `lmcache-rs server` on free ports with L1 segment `name` and `extra` flags, and
/// waits (at most 10 s) until the segment exists. Returns the child and the segment's path.
fn spawn_until_segment(name: &str, extra: &[&str]) -> (std::process::Child, std::path::PathBuf) {
    let child = bin()
        .args(["server", "--shm-name", name, "--port", "0", "--http-port", "0"])
        .args(extra)
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let path = std::path::Path::new("/dev/shm").join(name);
    let started = Instant::now();
    while !path.exists() {
        assert!(started.elapsed() < Duration::from_secs(10), "segment never appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    (child, path)
}

fn nix_kill(pid: u32) {
    let ok = Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(ok.success());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A server of 1 GiB L1 (segment `<prefix>_<pid>`) to bench, and its MP URL.
fn bench_target(prefix: &str) -> (std::process::Child, String) {
    let port = free_port();
    let name = format!("{prefix}_{}", std::process::id());
    let server = bin()
        .args(["server", "--port", &port.to_string(), "--http-port", "0", "--shm-name", &name])
        .args(["--l1-size-gb", "1"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    (server, format!("tcp://127.0.0.1:{port}"))
}

#[test]
fn bench_server_round_trips_against_a_real_server() {
    let (mut server, url) = bench_target("lmcache_rs_cli_bench");
    let out = bin()
        .args(["bench", "server", "--rpc-url", &url, "--end", "3", "--format", "json"])
        .args(["--kvcache-shape-spec", "(2,64,16,1,64):float16:2", "--concurrency", "2"])
        .output()
        .unwrap();
    nix_kill(server.id());
    assert!(server.wait().unwrap().success());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for field in ["\"bytes_match\": 3", "\"warm_full_hit\": 3", "\"cold_full_miss\": 3"] {
        assert!(text.contains(field), "{field} missing in {text}");
    }
}

#[test]
fn bench_server_drives_both_transfer_paths_with_tp_and_mla_and_writes_csv_and_plot() {
    let (mut server, url) = bench_target("lmcache_rs_cli_bench_tp");
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 4] = [
        ("driven-tp2", &["--transfer-mode", "lmcache_driven", "--tp-size", "2"]),
        ("driven-mla", &["--transfer-mode", "lmcache_driven", "--tp-size", "2", "--use-mla"]),
        ("engine-tp2", &["--transfer-mode", "engine_driven", "--tp-size", "2"]),
        ("driven-2groups", &["--transfer-mode", "lmcache_driven"]),
    ];
    for (i, (case, flags)) in cases.iter().enumerate() {
        let spec = match *case {
            "driven-mla" => "(1,64,16,1,128):bfloat16:3",
            "driven-2groups" => "(1,64,16,1,64):float16:2;(2,64,16,2,64):float16:3",
            _ => "(2,64,16,2,64):float16:3",
        };
        let (csv, png) =
            (dir.path().join(format!("{case}.csv")), dir.path().join(format!("{case}.png")));
        let start = (i * 100).to_string();
        let end = (i * 100 + 3).to_string();
        let out = bin()
            .args(["bench", "server", "--rpc-url", &url, "--start", &start, "--end", &end])
            .args(["--format", "json", "--kvcache-shape-spec", spec])
            .args(*flags)
            .arg("--csv")
            .arg(&csv)
            .arg("--plot")
            .arg(&png)
            .output()
            .unwrap();
        assert!(out.status.success(), "{case}: {}", String::from_utf8_lossy(&out.stderr));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["bytes_match"], 3, "{case}: {doc}");
        assert_eq!(doc["warm_full_hit"], 3, "{case}");
        assert_eq!(doc["metrics"]["results"]["checksum_ok"], 3, "{case}: LMCache's document");
        assert_eq!(doc["title"], "Server Bench Result");
        let rows = std::fs::read_to_string(&csv).unwrap();
        assert_eq!(rows.lines().count(), 1 + 4 * 3, "{case}: a row per timed operation");
        assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG", "{case}");
    }
    // A spec the chosen path cannot serve is refused by name.
    let out = bin()
        .args([
            "bench",
            "server",
            "--rpc-url",
            &url,
            "--kvcache-shape-spec",
            "(1,64,16,1,64):float16:1;(2,64,16,2,64):float16:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("lmcache_driven"));
    nix_kill(server.id());
    assert!(server.wait().unwrap().success());
}

#[test]
fn operator_commands_against_a_real_server() {
    let (port, http) = (free_port(), free_port());
    let name = format!("lmcache_rs_cli_ops_{}", std::process::id());
    // Two L1s (LMCache's --l1-manager list): describe lists each by its tag. The second names
    // a segment of its own, as LMCache lets each DRAM L1 do.
    let more = format!("{name}_more");
    let more_entry =
        format!(r#"{{"type": "DRAM", "tag": "more", "size_gb": 0.5, "shm_name": "{more}"}}"#);
    let mut server = bin()
        .args(["server", "--port", &port.to_string(), "--http-port", &http.to_string()])
        .args(["--shm-name", &name])
        .args(["--l1-manager", r#"{"type": "DRAM", "tag": "dram", "size_gb": 1}"#])
        .args(["--l1-manager", &more_entry])
        .args(["--l2-adapter", r#"{"type": "mock", "max_size_gb": 0.1}"#])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{http}");
    let run = |args: &[&str]| {
        let out = bin().args(args).args(["--url", &url]).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Wait for the server.
    let started = Instant::now();
    while run(&["ping", "kvcache", "-q"]).0 != Some(0) {
        assert!(started.elapsed() < Duration::from_secs(10), "server never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, out, _) = run(&["ping", "kvcache"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("OK"), "{out}");
    let (code, out, _) = run(&["describe", "kvcache", "--format", "json"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("\"chunk_size\": 256") && out.contains("l1_manager"), "{out}");
    let (_, out, _) = run(&["describe", "kvcache"]);
    assert!(out.contains("Eviction policy") && out.contains("LRU"), "{out}");
    assert!(out.contains("L2 adapter 0") && out.contains("mock (healthy)"), "{out}");
    assert!(out.contains("GB used"), "describe shows L2 used/capacity: {out}");
    assert!(out.contains("L1 dram") && out.contains("L1 more"), "each L1 by its tag: {out}");
    assert!(out.contains("L1 capacity (GB)") && out.contains("1.50"), "both L1s' sum: {out}");
    let segment = std::path::Path::new("/dev/shm").join(&more);
    assert!(segment.exists(), "the second L1's own segment");
    // An L2 quota is its own: set and listed with --tier l2, absent from L1's list.
    assert_eq!(run(&["quota", "set", "team-l2", "--limit-gb", "3", "--tier", "l2"]).0, Some(0));
    let (_, out, _) = run(&["quota", "list", "--tier", "l2", "--format", "json"]);
    assert!(out.contains("team-l2") && out.contains("\"limit_gb\": 3.0"), "{out}");
    let (_, out, _) = run(&["quota", "list", "--format", "json"]);
    assert!(!out.contains("team-l2"), "an L2 quota in L1's list: {out}");
    assert_eq!(run(&["quota", "set", "team-a", "--limit-gb", "2"]).0, Some(0));
    let (_, out, _) = run(&["quota", "list", "--format", "json"]);
    assert!(out.contains("team-a") && out.contains("\"limit_gb\": 2.0"), "{out}");
    let (_, out, _) = run(&["quota", "get", "team-a"]);
    assert!(out.contains("true"), "{out}");
    let (_, out, _) = run(&["quota", "delete", "team-a"]);
    assert!(out.contains("removed"), "{out}");
    let (code, _, err) = run(&["quota", "set", "a/b", "--limit-gb", "1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("cache_salt"), "the refusal must name the field: {err}");
    let (code, out, _) = run(&["kvcache", "clear"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("ok"), "{out}");
    nix_kill(server.id());
    assert!(server.wait().unwrap().success());
    assert!(!segment.exists(), "a stop removes the second L1's segment");
    // The server is gone: ping fails with exit code 1.
    let (code, out, _) = run(&["ping", "kvcache"]);
    assert_eq!(code, Some(1));
    assert!(out.contains("FAIL"), "{out}");
}

#[test]
fn operator_commands_send_the_bearer_token() {
    let (port, http) = (free_port(), free_port());
    let name = format!("lmcache_rs_cli_auth_{}", std::process::id());
    let mut server = bin()
        .args(["server", "--port", &port.to_string(), "--http-port", &http.to_string()])
        .args(["--shm-name", &name, "--l1-size-gb", "1"])
        .env("LMCACHE_RS_HTTP_TOKEN", "t0k")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{http}");
    let started = Instant::now();
    while bin().args(["ping", "kvcache", "-q", "--url", &url]).status().unwrap().code() != Some(0) {
        assert!(started.elapsed() < Duration::from_secs(10), "server never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let no = bin()
        .args(["describe", "kvcache", "--url", &url])
        .env_remove("LMCACHE_RS_HTTP_TOKEN")
        .output()
        .unwrap();
    assert_eq!(no.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&no.stderr).contains("401"));
    let yes =
        bin().args(["describe", "kvcache", "--url", &url, "--token", "t0k"]).output().unwrap();
    assert_eq!(yes.status.code(), Some(0), "{}", String::from_utf8_lossy(&yes.stderr));
    let env = bin()
        .args(["describe", "kvcache", "--url", &url])
        .env("LMCACHE_RS_HTTP_TOKEN", "t0k")
        .output()
        .unwrap();
    assert_eq!(env.status.code(), Some(0));
    nix_kill(server.id());
    assert!(server.wait().unwrap().success());
}

/// A minimal OTLP/HTTP receiver: answers every request 200 and keeps the bodies.
fn otlp_receiver() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = Vec::new();
            let mut chunk = [0u8; 65536];
            // Read the head, then Content-Length bytes of body.
            let body_len = loop {
                let Ok(n) = c.read(&mut chunk) else { break None };
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..p]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    break Some((p + 4, len));
                }
            };
            let Some((start, len)) = body_len else { continue };
            while buf.len() < start + len {
                match c.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            sink.lock().unwrap().extend_from_slice(&buf);
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (port, got)
}

#[test]
fn spans_are_exported_over_otlp() {
    let (otlp, got) = otlp_receiver();
    let port = free_port();
    let name = format!("lmcache_rs_cli_otlp_{}", std::process::id());
    let mut server = bin()
        .args(["server", "--port", &port.to_string(), "--http-port", "0", "--shm-name", &name])
        .args(["--l1-size-gb", "0.1", "--otlp-endpoint", &format!("http://127.0.0.1:{otlp}")])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("tcp://127.0.0.1:{port}");
    let out = bin()
        .args(["bench", "server", "--rpc-url", &url, "--end", "2", "--format", "json"])
        .args(["--kvcache-shape-spec", "(2,64,16,1,64):float16:2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    nix_kill(server.id()); // shutdown flushes the batch exporter
    assert!(server.wait().unwrap().success());
    let body = got.lock().unwrap().clone();
    let has = |s: &str| body.windows(s.len()).any(|w| w == s.as_bytes());
    assert!(has("POST /v1/traces"), "no OTLP export arrived");
    for s in ["mp_request", "lookup", "req-0-cold", "lmcache-rs"] {
        assert!(has(s), "exported spans lack {s:?}");
    }
}

#[test]
fn take_over_signals_only_an_lmcache_rs_server() {
    let out = bin().args(["server", "--take-over"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--l1-devdax-path"), "{err}");
    // This test process holds the file: the new server names it and leaves it alone (a
    // SIGTERM to it would end this test).
    let dir = std::env::temp_dir().join(format!("lmcache-rs-take-over-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("l1");
    std::fs::write(&file, b"").unwrap();
    let held = nix::fcntl::Flock::lock(
        std::fs::File::open(&file).unwrap(),
        nix::fcntl::FlockArg::LockExclusiveNonblock,
    )
    .unwrap();
    let out = bin()
        .args(["server", "--port", "0", "--http-port", "0", "--l1-size-gb", "0.1"])
        .args(["--l1-devdax-path", file.to_str().unwrap(), "--l1-warm-restart", "--take-over"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let me = std::process::id().to_string();
    assert!(
        !out.status.success() && err.contains("not an lmcache-rs server") && err.contains(&me),
        "{err}"
    );
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a client probing a server's two ports saw.
#[derive(Debug, Default)]
struct Probes {
    /// Connections refused, by port.
    refused: Vec<u16>,
    /// HTTP requests answered 200.
    http_ok: u32,
    /// HTTP requests accepted but not answered (the connection closed first).
    http_failed: Vec<String>,
    /// TCP connections the transport's port accepted.
    transport_connects: u32,
}

fn http_get_on(mut s: std::net::TcpStream, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Connects to `transport` and `http` (a GET /healthcheck on each connection) every 2 ms
/// until `stop`.
fn probe_ports(
    transport: u16,
    http: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Probes> {
    std::thread::spawn(move || {
        let mut p = Probes::default();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for port in [transport, http] {
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(20)) {
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        p.refused.push(port)
                    }
                    Err(e) => p.http_failed.push(format!("connect {port}: {e}")),
                    Ok(_) if port == transport => p.transport_connects += 1,
                    Ok(s) => match http_get_on(s, "/healthcheck") {
                        Ok(r) if r.starts_with("HTTP/1.1 200") => p.http_ok += 1,
                        Ok(r) => p.http_failed.push(format!("answer {r:?}")),
                        Err(e) => p.http_failed.push(format!("read: {e}")),
                    },
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        p
    })
}

#[test]
fn take_over_hands_the_ports_over_so_no_connection_is_refused() {
    take_over_under_probes("zmq");
    take_over_under_probes("grpc");
}

fn take_over_under_probes(transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("l1");
    let (port, http) = (free_port(), free_port());
    let spawn = |take_over: bool, log: &std::path::Path| {
        let out = std::fs::File::create(log).unwrap();
        let mut cmd = bin();
        cmd.args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--http-port", &http.to_string(), "--l1-size-gb", "0.1", "--log-level", "info"])
            .args(["--l1-devdax-path", file.to_str().unwrap(), "--l1-warm-restart"])
            .args(["--transport", transport])
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if take_over {
            cmd.arg("--take-over");
        }
        cmd.spawn().unwrap()
    };
    let healthy = |within: Duration| {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], http));
            if let Ok(s) = std::net::TcpStream::connect(addr) {
                if http_get_on(s, "/healthcheck").is_ok_and(|r| r.starts_with("HTTP/1.1 200")) {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    };
    let (old_log, new_log) = (dir.path().join("old.log"), dir.path().join("new.log"));
    let mut old = spawn(false, &old_log);
    assert!(healthy(Duration::from_secs(30)), "{}", std::fs::read_to_string(&old_log).unwrap());

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = probe_ports(port, http, std::sync::Arc::clone(&stop));
    std::thread::sleep(Duration::from_millis(200));
    let mut new = spawn(true, &new_log);
    let old_status = old.wait().unwrap();
    let t0 = Instant::now();
    while !std::fs::read_to_string(&new_log).unwrap().contains("took over") {
        assert!(t0.elapsed() < Duration::from_secs(30), "the new server never took over");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let probes = prober.join().unwrap();
    let log = std::fs::read_to_string(&new_log).unwrap();
    nix_kill(new.id());
    assert!(new.wait().unwrap().success());

    assert!(old_status.success(), "{transport}: the old server exited {old_status}");
    assert!(log.contains("ports_handed_over=[Transport, Http]"), "{transport}: {log}");
    assert!(
        probes.refused.is_empty() && probes.http_failed.is_empty(),
        "{transport}: connections refused or dropped across the upgrade: {probes:?}"
    );
    assert!(probes.http_ok >= 20 && probes.transport_connects >= 20, "{transport}: {probes:?}");
}

#[test]
fn a_second_server_on_a_slab_directory_is_refused_with_the_holders_pid() {
    let dir = tempfile::tempdir().unwrap();
    let slab = dir.path().to_str().unwrap();
    let server = |http: u16| {
        let mut cmd = bin();
        cmd.args(["server", "--port", "0", "--http-port", &http.to_string()]).args([
            "--gds-l1-path",
            slab,
            "--l1-size-gb",
            "0.1",
            "--gds-l1-staging-gb",
            "0.05",
        ]);
        cmd
    };
    let http = free_port();
    let mut first = server(http).stderr(std::process::Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", http)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the first server never served");
        std::thread::sleep(Duration::from_millis(20));
    }
    // (Were it not refused, it would stop by itself.)
    let out = server(free_port()).args(["--exit-after-seconds", "5"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    nix_kill(first.id());
    assert!(first.wait().unwrap().success());
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("in use by pid {}", first.id())), "{err}");
}
