// Migrations are embedded with `sqlx::migrate!`; rebuild when one changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
