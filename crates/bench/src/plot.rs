//! `plot --input <dirs or files> --output docs/benchmarks.png`: turns/s and p99 round trip versus
//! users, one series per system, from the JSON lines `peers` and `turns` printed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use plotters::prelude::*;
use serde_json::Value;

/// Arguments of `plot`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// JSON-lines files, or directories whose `*.json` and `*.jsonl` files are read.
    #[arg(long, num_args = 1.., default_value = "docs/benchmarks")]
    input: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(long, default_value = "docs/benchmarks.png")]
    output: PathBuf,
    /// A TrueType font for the labels (default: the first of the usual system paths found).
    #[arg(long)]
    font: Option<PathBuf>,
}

/// Where Debian, Fedora, Arch and Alpine put a sans-serif TrueType font.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

/// One measured point of a series.
#[derive(Debug, Clone)]
struct Point {
    per_sec: f64,
    p99_ms: f64,
    /// The machine of the run the point comes from.
    machine: String,
}

/// Series by system name, each by user count; a later line for the same point replaces it.
type Series = BTreeMap<String, BTreeMap<u64, Point>>;

const SYSTEMS: &[(&str, RGBColor)] = &[
    ("converger", RGBColor(0xd6, 0x27, 0x28)),
    ("store", RGBColor(0xff, 0x7f, 0x0e)),
    ("redis", RGBColor(0x1f, 0x77, 0xb4)),
    ("jetstream", RGBColor(0x2c, 0xa0, 0x2c)),
    ("pgbench", RGBColor(0x55, 0x55, 0x55)),
];

/// Reads the inputs and writes the chart.
pub fn run(args: PlotArgs) -> anyhow::Result<()> {
    load_font(args.font.as_deref())?;
    let files = input_files(&args.input)?;
    let mut series = Series::new();
    let mut lines = 0;
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        for line in text
            .lines()
            .filter(|line| line.trim_start().starts_with('{'))
        {
            let Ok(result) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            if add_result(&mut series, &result) {
                lines += 1;
            }
        }
    }
    if series.is_empty() {
        bail!(
            "no `peers` or `turns` results in {}",
            files
                .iter()
                .map(|file| file.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Only the machines of the points drawn: a replaced line's machine is not on the chart.
    let machines: BTreeSet<&str> = series
        .values()
        .flat_map(|points| points.values().map(|point| point.machine.as_str()))
        .collect();
    let machines: Vec<&str> = machines.into_iter().collect();
    draw(&series, &machines.join("; "), &args.output)?;
    println!(
        "{} results from {} files → {}",
        lines,
        files.len(),
        args.output.display()
    );
    for (system, points) in &series {
        let users: Vec<String> = points.keys().map(u64::to_string).collect();
        println!("  {system}: users {}", users.join(", "));
    }
    Ok(())
}

fn load_font(explicit: Option<&Path>) -> anyhow::Result<()> {
    let path = match explicit {
        Some(path) => path.to_owned(),
        None => FONT_CANDIDATES
            .iter()
            .map(PathBuf::from)
            .find(|path| path.is_file())
            .ok_or_else(|| {
                anyhow!(
                    "no TrueType font found (looked for {}); install one (Debian: apt-get \
                     install fonts-dejavu-core) or pass --font FILE.ttf",
                    FONT_CANDIDATES.join(", ")
                )
            })?,
    };
    let bytes = std::fs::read(&path).with_context(|| format!("read font {}", path.display()))?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{} is not a usable TrueType font", path.display()))
}

fn input_files(inputs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        if !input.is_dir() {
            files.push(input.clone());
            continue;
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(input)
            .with_context(|| format!("read {}", input.display()))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| {
                path.extension()
                    .is_some_and(|extension| extension == "json" || extension == "jsonl")
            })
            .collect();
        found.sort();
        files.extend(found);
    }
    Ok(files)
}

/// Adds the points of one `peers` or `turns` line; false for any other line.
fn add_result(series: &mut Series, result: &Value) -> bool {
    let Some(users) = result["users"].as_u64() else {
        return false;
    };
    let machine = describe_machine(&result["machine"]);
    match result["bench"].as_str() {
        // A paced run's point is not on the closed-loop curves.
        Some("turns") if !result["rate"].is_null() => return false,
        Some("turns") => add_loop(series, "converger", users, result, &machine),
        Some("peers") => {
            for system in ["converger", "store", "redis", "jetstream"] {
                add_loop(series, system, users, &result["systems"][system], &machine);
            }
            let ceiling = &result["systems"]["pgbench"];
            if let Some(tps) = ceiling["tps"].as_f64() {
                let p99_ms = ceiling["latency_ms"]["p99"].as_f64().unwrap_or(f64::NAN);
                series.entry("pgbench".to_owned()).or_default().insert(
                    users,
                    Point {
                        per_sec: tps,
                        p99_ms,
                        machine,
                    },
                );
            }
        }
        _ => return false,
    }
    true
}

fn add_loop(series: &mut Series, system: &str, users: u64, figures: &Value, machine: &str) {
    let Some(per_sec) = figures["turns_per_sec"].as_f64() else {
        return;
    };
    let p99_ms = figures["round_trip_ms"]["p99"].as_f64().unwrap_or(f64::NAN);
    series.entry(system.to_owned()).or_default().insert(
        users,
        Point {
            per_sec,
            p99_ms,
            machine: machine.to_owned(),
        },
    );
}

fn plot_error<E: std::fmt::Display>(error: E) -> anyhow::Error {
    anyhow!("drawing the chart: {error}")
}

fn describe_machine(machine: &Value) -> String {
    format!(
        "{} CPUs ({}), {:.0} GiB",
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or("?"),
        machine["memory_kib"].as_f64().unwrap_or(0.0) / 1024.0 / 1024.0
    )
}

fn draw(series: &Series, machines: &str, output: &Path) -> anyhow::Result<()> {
    if let Some(parent) = output
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent)?;
    }
    let mut pixels = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    render(series, machines, &mut pixels)?;
    write_png(output, &pixels)
}

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 640;

fn write_png(output: &Path, rgb: &[u8]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(output).with_context(|| format!("create {}", output.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(())
}

fn render(series: &Series, machines: &str, pixels: &mut [u8]) -> anyhow::Result<()> {
    let all_points = || series.values().flat_map(|points| points.iter());
    let min_users = all_points()
        .map(|(users, _)| *users)
        .min()
        .unwrap_or(1)
        .max(1) as f64;
    let max_users = all_points()
        .map(|(users, _)| *users)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    // At least a factor of 8 wide: plotters puts no tick on a narrower log axis.
    let users_range = (min_users / 2.0).min(max_users / 8.0)..(max_users * 2.0);
    let max_rate = all_points()
        .map(|(_, point)| point.per_sec)
        .fold(1.0, f64::max);
    let latencies = || {
        all_points()
            .map(|(_, point)| point.p99_ms)
            .filter(|p99| p99.is_finite() && *p99 > 0.0)
    };
    let min_latency = latencies().fold(f64::INFINITY, f64::min).min(1.0);
    let max_latency = latencies().fold(1.0, f64::max);

    let root = BitMapBackend::with_buffer(pixels, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let (title, body) = root.split_vertically(70);
    let subtitle = title
        .titled(
            "converger against its peers: U users in closed loop, A agents (durable round trip)",
            ("sans-serif", 24),
        )
        .map_err(plot_error)?;
    subtitle
        .draw_text(
            &format!("measured on {machines}"),
            &("sans-serif", 16).into_text_style(&subtitle),
            (12, 8),
        )
        .map_err(plot_error)?;
    let panels = body.split_evenly((1, 2));

    let mut rate_chart = ChartBuilder::on(&panels[0])
        .caption(
            "throughput (pgbench: single-row insert tps)",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(users_range.clone().log_scale(), 0.0..max_rate * 1.15)
        .map_err(plot_error)?;
    rate_chart
        .configure_mesh()
        .x_desc("users (log scale)")
        .y_desc("turns per second")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .x_label_formatter(&|users| format!("{users:.0}"))
        .y_label_formatter(&|rate| format!("{rate:.0}"))
        .draw()
        .map_err(plot_error)?;
    for (system, color) in SYSTEMS {
        let Some(points) = series.get(*system) else {
            continue;
        };
        let line: Vec<(f64, f64)> = points
            .iter()
            .map(|(users, point)| (*users as f64, point.per_sec))
            .collect();
        draw_series(&mut rate_chart, system, *color, &line)?;
    }
    rate_chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;

    let mut latency_chart = ChartBuilder::on(&panels[1])
        .caption(
            "p99 round trip (pgbench: p99 insert latency)",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(
            users_range.log_scale(),
            ((min_latency / 2.0)..(max_latency * 2.0)).log_scale(),
        )
        .map_err(plot_error)?;
    latency_chart
        .configure_mesh()
        .x_desc("users (log scale)")
        .y_desc("milliseconds (log scale)")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .x_label_formatter(&|users| format!("{users:.0}"))
        .y_label_formatter(&|millis| format!("{millis}"))
        .draw()
        .map_err(plot_error)?;
    for (system, color) in SYSTEMS {
        let Some(points) = series.get(*system) else {
            continue;
        };
        let line: Vec<(f64, f64)> = points
            .iter()
            .filter(|(_, point)| point.p99_ms.is_finite() && point.p99_ms > 0.0)
            .map(|(users, point)| (*users as f64, point.p99_ms))
            .collect();
        draw_series(&mut latency_chart, system, *color, &line)?;
    }
    latency_chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

type Chart<'a, 'b, Y> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, Y>>;

/// A line with its points; the pgbench ceiling is dashed so it reads as a limit, not a peer.
fn draw_series<Y>(
    chart: &mut Chart<'_, '_, Y>,
    system: &str,
    color: RGBColor,
    line: &[(f64, f64)],
) -> anyhow::Result<()>
where
    Y: Ranged<ValueType = f64>,
{
    if line.is_empty() {
        return Ok(());
    }
    let style = color.stroke_width(3);
    let label = match system {
        "pgbench" => "pgbench ceiling",
        "store" => "converger's store alone",
        _ => system,
    };
    if system == "pgbench" {
        chart
            .draw_series(DashedLineSeries::new(line.iter().copied(), 10, 6, style))
            .map_err(plot_error)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    } else {
        chart
            .draw_series(LineSeries::new(line.iter().copied(), style))
            .map_err(plot_error)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    chart
        .draw_series(
            line.iter()
                .map(|point| Circle::new(*point, 5, color.filled())),
        )
        .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns_line(users: u64, rate: Value, per_sec: f64) -> Value {
        serde_json::json!({
            "bench": "turns",
            "users": users,
            "rate": rate,
            "turns_per_sec": per_sec,
            "round_trip_ms": {"p99": 10.0},
            "machine": {"cpus": 2, "cpu_model": "test", "memory_kib": 1024},
        })
    }

    #[test]
    fn a_paced_turns_line_is_not_a_closed_loop_point() {
        let mut series = Series::new();
        assert!(add_result(
            &mut series,
            &turns_line(64, Value::Null, 2000.0)
        ));
        assert!(!add_result(
            &mut series,
            &turns_line(64, serde_json::json!(1000.0), 999.0)
        ));
        let point = &series["converger"][&64];
        assert_eq!(point.per_sec, 2000.0);
    }
}
