//! The `--config FILE` of `serve`: a TOML file whose keys are the long
//! flags' names without `--` (docs/settings.md, "Config file"), read through
//! the one table of settings ([`SETTINGS`]), so every flag is a key and no
//! second list exists. A key is checked against the table and its value's
//! type against the setting; a refusal names the file, the key and its line.

use super::{is_secret_value, setting_named, Setting};
use crate::held::check_secret_mode;
use std::path::Path;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

#[cfg(doc)]
use super::SETTINGS;

/// One key of the file: its setting, its line, and its values as the
/// command line would give them (one per value; `""` for a switch set to
/// `true`, none for `false`).
pub(super) struct Entry {
    pub setting: &'static Setting,
    pub line: usize,
    pub values: Vec<String>,
}

/// The file's keys in the order they appear in it, each checked against
/// the table; a file that holds a secret's value is checked like a secret
/// file (no access for every user of the host).
pub(super) fn read(path: &Path, warnings: &mut Vec<String>) -> Result<Vec<Entry>, String> {
    let shown = path.display();
    let metadata = std::fs::metadata(path).map_err(|e| format!("--config {shown}: cannot read it: {e}"))?;
    if !metadata.is_file() {
        return Err(format!("--config {shown}: not a file"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {shown}: cannot read it: {e}"))?;
    let entries = parse(&text).map_err(|(line, message)| format!("{shown} line {line}: {message}"))?;
    if entries.iter().any(|e| is_secret_value(e.setting.name)) {
        check_secret_mode("config", &shown.to_string(), &metadata, warnings)?;
    }
    Ok(entries)
}

/// The 1-based line of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|b| **b == b'\n').count() + 1
}

/// The entries of a config file's text, or (the line, why) of its first
/// refusal.
fn parse(text: &str) -> Result<Vec<Entry>, (usize, String)> {
    let table = DeTable::parse(text).map_err(|e| {
        let line = e.span().map_or(1, |span| line_of(text, span.start));
        (line, format!("not TOML: {}", e.message().split_whitespace().collect::<Vec<_>>().join(" ")))
    })?;
    let mut keys: Vec<(&Spanned<_>, &Spanned<DeValue<'_>>)> = table.get_ref().iter().collect();
    keys.sort_by_key(|(key, _)| key.span().start);
    let mut entries = Vec::with_capacity(keys.len());
    for (key, value) in keys {
        let name: &str = key.get_ref();
        let line = line_of(text, key.span().start);
        let Some(setting) = setting_named(name) else {
            return Err((
                line,
                format!("unknown key {name:?} (the keys are serve's long flags without --, docs/settings.md)"),
            ));
        };
        let values = values(setting, value.get_ref())
            .map_err(|(found, expected)| (line, format!("{name}: expected {expected}, found {found}")))?;
        entries.push(Entry { setting, line, values });
    }
    Ok(entries)
}

/// What `setting` takes in the file, as the command line's values, or
/// (what was found, what it takes).
fn values(setting: &Setting, value: &DeValue<'_>) -> Result<Vec<String>, (&'static str, &'static str)> {
    if !setting.takes_value {
        return match value {
            DeValue::Boolean(true) => Ok(vec![String::new()]),
            DeValue::Boolean(false) => Ok(Vec::new()),
            other => Err((other.type_str(), "true or false")),
        };
    }
    let scalar = |value: &DeValue<'_>| match value {
        DeValue::String(s) => Some(s.to_string()),
        DeValue::Integer(n) => integer(n.as_str(), n.radix()),
        _ => None,
    };
    if setting.repeatable {
        let expected = "a string or a list of strings";
        return match value {
            DeValue::Array(items) => {
                items.iter().map(|item| scalar(item.get_ref()).ok_or((item.get_ref().type_str(), expected))).collect()
            }
            other => scalar(other).map(|v| vec![v]).ok_or((other.type_str(), expected)),
        };
    }
    scalar(value).map(|v| vec![v]).ok_or((value.type_str(), "a string or an integer"))
}

/// A TOML integer as the decimal text a flag takes.
fn integer(digits: &str, radix: u32) -> Option<String> {
    i64::from_str_radix(digits, radix).ok().map(|n| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> (usize, String) {
        match parse(text) {
            Ok(_) => panic!("accepted: {text}"),
            Err(refused) => refused,
        }
    }

    #[test]
    fn keys_are_the_flags_and_values_their_types() {
        let entries = parse(
            "workers = 3\n\n# a comment\ncoupon = [\"A\", \"B\"]\ndev = true\nlisten = \"127.0.0.1:0\"\nwebhook-url = \"http://h/x\"\n",
        )
        .expect("parsed");
        let seen: Vec<(&str, usize, Vec<String>)> =
            entries.iter().map(|e| (e.setting.name, e.line, e.values.clone())).collect();
        assert_eq!(
            seen,
            vec![
                ("workers", 1, vec!["3".to_owned()]),
                ("coupon", 4, vec!["A".to_owned(), "B".to_owned()]),
                ("dev", 5, vec![String::new()]),
                ("listen", 6, vec!["127.0.0.1:0".to_owned()]),
                ("webhook-url", 7, vec!["http://h/x".to_owned()]),
            ]
        );
        assert!(parse("dev = false\n").expect("parsed")[0].values.is_empty());
        assert_eq!(parse("workers = 0x10\n").expect("hex")[0].values, vec!["16".to_owned()]);
    }

    #[test]
    fn a_refusal_names_the_key_and_its_line() {
        assert_eq!(refusal("workers = 2\n\nwrokers = 3\n").0, 3);
        assert!(refusal("wrokers = 3\n").1.contains("unknown key \"wrokers\""));
        let (line, message) = refusal("db = \"x\"\nworkers = [1]\n");
        assert_eq!(line, 2);
        assert!(message.contains("workers") && message.contains("array"), "{message}");
        assert!(refusal("dev = \"yes\"\n").1.contains("true or false"));
        assert!(refusal("coupon = [\"A\", 1.5]\n").1.contains("float"));
        assert!(refusal("[db]\npath = 1\n").1.contains("table"));
        assert!(refusal("config = \"other.toml\"\n").1.contains("unknown key"));
        assert_eq!(refusal("workers = 2\nlisten = \n").0, 2);
    }
}
