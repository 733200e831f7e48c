//! PNG charts (plotters' bitmap backend, the DejaVu Sans font embedded: no system fonts or
//! matplotlib needed): the cache simulator's seven statistics panels and its hit rate vs
//! capacity curve, and the benchmarks' latency histograms and throughput over time.

use std::ops::Range;
use std::path::Path;
use std::sync::Once;

use anyhow::anyhow;
use plotters::coord::Shift;
use plotters::prelude::*;

const FONT: &str = "sans-serif";
const BLUE: RGBColor = RGBColor(0x4c, 0x72, 0xb0);
const ORANGE: RGBColor = RGBColor(0xdd, 0x84, 0x52);
const GREEN: RGBColor = RGBColor(0x55, 0xa8, 0x68);
const RED: RGBColor = RGBColor(0xc4, 0x4e, 0x52);
const PURPLE: RGBColor = RGBColor(0x81, 0x72, 0xb3);
/// Series colours, in order.
pub const PALETTE: [RGBColor; 5] = [BLUE, ORANGE, GREEN, RED, PURPLE];

fn fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TTF bundled by the `dejavu` crate; a failure leaves text out.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// A histogram of `values` in `bins` equal bins over `range` (values outside are left out).
pub struct Histogram<'a> {
    /// Panel title.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Samples.
    pub values: &'a [f64],
    /// Bins.
    pub bins: usize,
    /// X range (`None`: the values' min..max).
    pub range: Option<Range<f64>>,
    /// A note in the top-right corner.
    pub note: Option<String>,
}

fn bin_counts(values: &[f64], bins: usize, r: &Range<f64>) -> Vec<u64> {
    let mut counts = vec![0u64; bins.max(1)];
    let width = (r.end - r.start) / counts.len() as f64;
    for &v in values {
        if !(v >= r.start && v <= r.end) {
            continue;
        }
        let i = if width > 0.0 { ((v - r.start) / width) as usize } else { 0 };
        let last = counts.len() - 1;
        counts[i.min(last)] += 1;
    }
    counts
}

fn draw_histogram(area: &Area<'_>, h: &Histogram<'_>) -> anyhow::Result<()> {
    let lo = h.values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = h.values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // Whole numbers over a short span get one bar per value, centred on it.
    let integral =
        lo.is_finite() && h.values.iter().all(|v| v.fract() == 0.0) && hi - lo < h.bins as f64;
    let (range, bins) = match (&h.range, integral) {
        (Some(r), _) => (r.clone(), h.bins),
        (None, true) => (lo - 0.5..hi + 0.5, (hi - lo) as usize + 1),
        (None, false) if lo.is_finite() && hi > lo => (lo..hi, h.bins),
        (None, false) if lo.is_finite() => (lo - 0.5..lo + 0.5, 1),
        (None, false) => (0.0..1.0, h.bins),
    };
    let counts = bin_counts(h.values, bins, &range);
    let top = counts.iter().copied().max().unwrap_or(0).max(1) as f64 * 1.08;
    let mut chart = ChartBuilder::on(area)
        .caption(h.title, (FONT, 17).into_font().style(FontStyle::Bold))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(58)
        .build_cartesian_2d(range.clone(), 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(h.x_label)
        .y_desc(h.y_label)
        .y_labels(if top < 10.0 { top as usize + 1 } else { 10 })
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| if integral { format!("{v:.0}") } else { format!("{v}") })
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    let width = (range.end - range.start) / counts.len() as f64;
    chart
        .draw_series(counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, &c)| {
            let x0 = range.start + i as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, c as f64)], BLUE.mix(0.85).filled())
        }))
        .map_err(err)?;
    chart
        .draw_series(counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, &c)| {
            let x0 = range.start + i as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, c as f64)], BLACK.stroke_width(1))
        }))
        .map_err(err)?;
    if h.values.is_empty() {
        area.draw(&Text::new(
            "(no samples)",
            (area.dim_in_pixel().0 as i32 / 2 - 40, area.dim_in_pixel().1 as i32 / 2),
            (FONT, 14),
        ))
        .map_err(err)?;
    }
    if let Some(note) = &h.note {
        let (w, _) = area.dim_in_pixel();
        for (i, line) in note.lines().enumerate() {
            area.draw(&Text::new(
                line.to_owned(),
                (w as i32 - 250, 40 + 16 * i as i32),
                (FONT, 13),
            ))
            .map_err(err)?;
        }
    }
    Ok(())
}

/// A line per series over a shared x axis.
pub struct Lines<'a> {
    /// Panel title.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// `(name, points)` per series.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// Log-scaled x axis.
    pub log_x: bool,
    /// Fixed y range (`None`: 0..max).
    pub y_range: Option<Range<f64>>,
    /// Marks at each point.
    pub markers: bool,
}

fn draw_lines(area: &Area<'_>, l: &Lines<'_>) -> anyhow::Result<()> {
    let xs = l.series.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x));
    let (mut lo, mut hi) =
        xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    if !lo.is_finite() {
        (lo, hi) = (1.0, 2.0);
    }
    if hi <= lo {
        hi = lo * 2.0 + 1.0;
    }
    let y = l.y_range.clone().unwrap_or_else(|| {
        let top = l.series.iter().flat_map(|(_, p)| p.iter().map(|&(_, y)| y)).fold(0.0, f64::max);
        0.0..(top * 1.1).max(1e-9)
    });
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(l.title, (FONT, 17).into_font().style(FontStyle::Bold))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(58);
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(l.x_label)
                .y_desc(l.y_label)
                .label_style((FONT, 12))
                .axis_desc_style((FONT, 13))
                .draw()
                .map_err(err)?;
            for (i, (name, pts)) in l.series.iter().enumerate() {
                let c = PALETTE[i % PALETTE.len()];
                chart
                    .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
                if l.markers {
                    chart
                        .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                        .map_err(err)?;
                }
            }
            if l.series.len() > 1 {
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .label_font((FONT, 13))
                    .position(SeriesLabelPosition::LowerRight)
                    .draw()
                    .map_err(err)?;
            }
        }};
    }
    if l.log_x && lo > 0.0 {
        body!(builder.build_cartesian_2d((lo..hi).log_scale(), y).map_err(err)?);
    } else {
        body!(builder.build_cartesian_2d(lo..hi, y).map_err(err)?);
    }
    Ok(())
}

/// Two pies (hit vs miss) side by side, with their shares written under them.
pub struct Pies<'a> {
    /// Panel title.
    pub title: &'a str,
    /// `(caption, hit, miss)` per pie.
    pub pies: Vec<(String, f64, f64)>,
}

fn draw_pies(area: &Area<'_>, p: &Pies<'_>) -> anyhow::Result<()> {
    let (w, h) = area.dim_in_pixel();
    // Pies are drawn in the backend's pixels: offset them to this panel.
    let (ox, oy) = area.get_base_pixel();
    area.draw(&Text::new(
        p.title.to_owned(),
        (20, 12),
        (FONT, 17).into_font().style(FontStyle::Bold),
    ))
    .map_err(err)?;
    let n = p.pies.len().max(1) as i32;
    let radius = ((w as i32 / n).min(h as i32 - 140) / 2 - 30).max(20) as f64;
    for (i, (caption, hit, miss)) in p.pies.iter().enumerate() {
        let cx = (w as i32 / n) * i as i32 + w as i32 / n / 2;
        let cy = h as i32 / 2;
        let (px, py) = (cx + ox, cy + oy);
        let total = hit + miss;
        let sizes = if total > 0.0 { vec![*hit, *miss] } else { vec![0.0, 1.0] };
        let share = |x: f64| if total > 0.0 { x / total * 100.0 } else { 0.0 };
        let labels = [format!("hit {:.0}%", share(*hit)), format!("miss {:.0}%", share(*miss))];
        let colors = [BLUE, ORANGE];
        let center = (px, py);
        let mut pie = Pie::new(&center, &radius, &sizes, &colors, &labels);
        pie.start_angle(-90.0);
        pie.label_style((FONT, 14).into_font());
        area.draw(&pie).map_err(err)?;
        area.draw(&Text::new(caption.clone(), (cx - 70, cy + radius as i32 + 30), (FONT, 14)))
            .map_err(err)?;
    }
    Ok(())
}

/// One panel of a figure.
pub enum Panel<'a> {
    /// A histogram.
    Histogram(Histogram<'a>),
    /// Lines.
    Lines(Lines<'a>),
    /// Pies.
    Pies(Pies<'a>),
}

/// Writes `panels` in a `cols`-wide grid, under `title`, to the PNG `path`.
pub fn figure(
    path: &Path,
    title: &str,
    cols: usize,
    panel_size: (u32, u32),
    panels: &[Panel<'_>],
) -> anyhow::Result<()> {
    fonts();
    let cols = cols.max(1);
    let rows = panels.len().div_ceil(cols).max(1);
    let size = (panel_size.0 * cols as u32, panel_size.1 * rows as u32 + 50);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (head, body) = root.split_vertically(50);
    head.draw(&Text::new(
        title.to_owned(),
        (20, 14),
        (FONT, 20).into_font().style(FontStyle::Bold),
    ))
    .map_err(err)?;
    let areas = body.split_evenly((rows, cols));
    for (area, panel) in areas.iter().zip(panels) {
        match panel {
            Panel::Histogram(h) => draw_histogram(area, h)?,
            Panel::Lines(l) => draw_lines(area, l)?,
            Panel::Pies(p) => draw_pies(area, p)?,
        }
    }
    root.present().map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_count_every_value_in_range_once() {
        let c = bin_counts(&[0.0, 0.5, 1.0, 9.99, 10.0, 11.0, -1.0, f64::NAN], 10, &(0.0..10.0));
        assert_eq!(c.iter().sum::<u64>(), 5);
        assert_eq!(c[0], 2);
        assert_eq!(c[9], 2, "the top edge falls in the last bin");
    }

    #[test]
    fn a_figure_is_a_png_of_the_grid_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.png");
        let v: Vec<f64> = (0..100).map(f64::from).collect();
        figure(
            &path,
            "t",
            2,
            (300, 200),
            &[
                Panel::Histogram(Histogram {
                    title: "h",
                    x_label: "x",
                    y_label: "y",
                    values: &v,
                    bins: 10,
                    range: None,
                    note: Some("n".into()),
                }),
                Panel::Lines(Lines {
                    title: "l",
                    x_label: "x",
                    y_label: "y",
                    series: vec![
                        ("a".into(), vec![(1.0, 1.0), (10.0, 5.0)]),
                        ("b".into(), vec![(1.0, 2.0), (10.0, 3.0)]),
                    ],
                    log_x: true,
                    y_range: None,
                    markers: true,
                }),
                Panel::Pies(Pies {
                    title: "p",
                    pies: vec![("r".into(), 3.0, 1.0), ("t".into(), 0.0, 0.0)],
                }),
                Panel::Histogram(Histogram {
                    title: "empty",
                    x_label: "x",
                    y_label: "y",
                    values: &[],
                    bins: 10,
                    range: None,
                    note: None,
                }),
            ],
        )
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16..24.
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (600, 450));
    }
}
