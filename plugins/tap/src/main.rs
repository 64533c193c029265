fn main() {
    tap::main()
}
