//! Answer extraction and token-overlap F1, as LMCache's `quality/scoring.py` scores
//! rag-qa-quality: the last `<final_answer>…</final_answer>` region (an unterminated last
//! region is no answer: generation was cut off), SQuAD-style normalization (lowercase, no
//! ASCII punctuation, no articles), the best F1 over the gold answers.

use std::sync::LazyLock;

use regex::Regex;

// Lazy, last region wins; an unfinished last region counts (and then is no answer). Both
// patterns are constant (the tests build them); `None` would only mean a regex-crate bug.
static FINAL_ANSWER: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"(?is)<final_answer>\s*(.*?)\s*(</final_answer>|\z)").ok());
static ARTICLES: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").ok());

/// The model's final answer, or "" when the last region is missing or unterminated.
pub fn extract_final_answer(output: &str) -> String {
    let Some(re) = FINAL_ANSWER.as_ref() else { return String::new() };
    match re.captures_iter(output).last() {
        Some(c) if c.get(2).is_some_and(|m| !m.as_str().is_empty()) => {
            c.get(1).map_or(String::new(), |m| m.as_str().trim().to_owned())
        }
        _ => String::new(),
    }
}

/// Lowercase, strip ASCII punctuation and articles, collapse whitespace.
pub fn normalize_answer(text: &str) -> String {
    let lowered: String =
        text.to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
    let spaced = match ARTICLES.as_ref() {
        Some(re) => re.replace_all(&lowered, " ").into_owned(),
        None => lowered,
    };
    spaced.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Token-overlap F1 of `prediction` against one `reference` (two empties score 1).
pub fn token_f1(prediction: &str, reference: &str) -> f64 {
    let (p, r) = (normalize_answer(prediction), normalize_answer(reference));
    let (p, r): (Vec<&str>, Vec<&str>) = (
        p.split(' ').filter(|w| !w.is_empty()).collect(),
        r.split(' ').filter(|w| !w.is_empty()).collect(),
    );
    if p.is_empty() || r.is_empty() {
        return f64::from(u8::from(p == r));
    }
    let mut unique = p.clone();
    unique.sort_unstable();
    unique.dedup();
    let overlap: usize = unique
        .iter()
        .map(|w| p.iter().filter(|x| *x == w).count().min(r.iter().filter(|x| *x == w).count()))
        .sum();
    if overlap == 0 {
        return 0.0;
    }
    let precision = overlap as f64 / p.len() as f64;
    let recall = overlap as f64 / r.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// The best F1 over `references` (0 with none).
pub fn best_f1(prediction: &str, references: &[String]) -> f64 {
    references.iter().map(|r| token_f1(prediction, r)).fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patterns_compile() {
        assert!(FINAL_ANSWER.is_some() && ARTICLES.is_some());
    }

    #[test]
    fn the_last_closed_region_is_the_answer_and_an_open_one_is_none() {
        assert_eq!(extract_final_answer("x <final_answer> Paris </final_answer>"), "Paris");
        assert_eq!(
            extract_final_answer(
                "e.g. <final_answer>X</final_answer> so <FINAL_ANSWER>\nLyon\n</final_answer> end"
            ),
            "Lyon"
        );
        // Cut off: the example before must not be scored.
        assert_eq!(
            extract_final_answer("<final_answer>X</final_answer> then <final_answer>Ly"),
            ""
        );
        assert_eq!(extract_final_answer("no tags"), "");
        assert_eq!(extract_final_answer("<final_answer></final_answer>"), "");
    }

    #[test]
    fn f1_is_squads() {
        assert_eq!(normalize_answer("The  Eiffel-Tower, in Paris!"), "eiffeltower in paris");
        assert_eq!(token_f1("the Paris", "Paris"), 1.0);
        assert_eq!(token_f1("", ""), 1.0);
        assert_eq!(token_f1("a", "Paris"), 0.0, "articles only normalize to nothing");
        // 1 shared of 2 predicted and 3 gold: p 1/2, r 1/3, F1 0.4.
        assert!((token_f1("paris france", "paris city centre") - 0.4).abs() < 1e-12);
        // Repeated words count at most as often as in the other side.
        assert!((token_f1("paris paris", "paris") - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(best_f1("Lyon", &["Paris".into(), "lyon".into()]), 1.0);
        assert_eq!(best_f1("Lyon", &[]), 0.0);
    }
}
