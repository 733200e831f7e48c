//! `lmcache-rs server --config FILE`: every server flag from a TOML file.
//!
//! Keys are the flag names (`l1_size_gb` or `l1-size-gb`); `[[l2_adapter]]` tables become
//! `--l2-adapter` JSON objects, in order. Flags given on the command line win over the file.
//! An unknown key is refused by clap like an unknown flag, naming it.

use anyhow::{Context, bail};

/// Expands `--config FILE` in `server` arguments into flags. `args` are the arguments after
/// `server`.
pub fn expand(args: Vec<String>) -> anyhow::Result<Vec<String>> {
    let (path, rest) = take_config(args, false)?;
    let Some(path) = path else { return Ok(rest) };
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {path}"))?;
    let table: toml::Table = toml::from_str(&text).with_context(|| format!("--config {path}"))?;
    let given = given_flags(&rest);
    let mut out = Vec::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        if given.contains(&flag) {
            continue;
        }
        match value {
            toml::Value::Boolean(true) => out.push(format!("--{flag}")),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                for v in items {
                    out.push(format!("--{flag}"));
                    out.push(scalar_or_json(&key, v)?);
                }
            }
            v => {
                out.push(format!("--{flag}"));
                out.push(scalar_or_json(&key, v)?);
            }
        }
    }
    out.extend(rest);
    Ok(out)
}

/// The file `--config FILE` (or `--config=FILE`) names in `args`, and the other arguments
/// (with the `--config` flag itself too when `keep`: a command that reads it again).
pub fn take_config(args: Vec<String>, keep: bool) -> anyhow::Result<(Option<String>, Vec<String>)> {
    let mut path = None;
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--config" {
            let p = it.next().context("--config needs a file")?;
            if keep {
                rest.extend([a, p.clone()]);
            }
            path = Some(p);
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_owned());
            if keep {
                rest.push(a);
            }
        } else {
            rest.push(a);
        }
    }
    Ok((path, rest))
}

/// The long flags on a command line, without `--` and any `=value`: what a config file
/// must not override.
pub fn given_flags(args: &[String]) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_owned())
        .collect()
}

fn scalar_or_json(key: &str, v: toml::Value) -> anyhow::Result<String> {
    Ok(match v {
        toml::Value::String(s) => s,
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Table(t) => serde_json::to_string(&t)?,
        other => bail!("--config: {key}: unsupported value {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_flags_tables_and_lets_the_command_line_win() {
        let dir = std::env::temp_dir().join(format!("lmcache-rs-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("server.toml");
        std::fs::write(
            &p,
            "l1_size_gb = 2.5\nport = 6000\nl1-mlock = true\ndisable_observability = false\n\
             [[l2_adapter]]\ntype = \"fs\"\nbase_path = \"/tmp/kv\"\n",
        )
        .unwrap();
        let args = vec!["--config".into(), p.display().to_string(), "--port".into(), "7000".into()];
        let out = expand(args).unwrap();
        let joined = out.join(" ");
        assert!(joined.contains("--l1-size-gb 2.5"), "{joined}");
        assert!(joined.contains("--l1-mlock"), "{joined}");
        assert!(!joined.contains("disable-observability"), "{joined}");
        assert!(
            joined.contains("--l2-adapter {\"base_path\":\"/tmp/kv\",\"type\":\"fs\"}"),
            "{joined}"
        );
        assert!(joined.contains("--port 7000") && !joined.contains("6000"), "{joined}");
        assert!(expand(vec!["--config".into()]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
