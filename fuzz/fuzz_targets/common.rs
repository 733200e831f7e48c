//! What the HTTP fuzz targets share: a route's path with every `{param}` filled in, and a
//! fuzzed string cut down to what may stand in a path segment or a query.

/// `s`'s printable characters that cannot end or split a path segment, at most `n`.
pub fn clean(s: &str, n: usize) -> String {
    s.chars().filter(|c| c.is_ascii_graphic() && !"#?/{}".contains(*c)).take(n).collect()
}

/// `path` with each `{param}` replaced by the fuzzed segment (`x` when it is empty).
pub fn fill(path: &str, param: &str) -> String {
    let param = clean(param, 64);
    let param = if param.is_empty() { "x".to_owned() } else { param };
    let mut path = path.to_owned();
    while let (Some(a), Some(b)) = (path.find('{'), path.find('}')) {
        if b < a {
            break;
        }
        path.replace_range(a..=b, &param);
    }
    path
}
