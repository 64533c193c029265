fn main() {
    fastpath::main()
}
